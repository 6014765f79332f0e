"""StepBatchSampler: which rows make up each optimizer step, resumably.

One item of this sampler is one optimizer step's rows for this rank. Order is a
pure function of (seed, epoch), so the position (data epoch, step in it) is all the
state a resumed run needs to continue without skipping or repeating a row.

The sampler counts data epochs itself instead of following Lightning's epoch number:
a checkpoint written when `max_steps` stops a run mid-epoch records Lightning's epoch
as finished, so a resumed run's Lightning epoch can be one ahead of the data.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class StepBatchSampler:
    def __init__(
        self, num_rows: int, batch_size: int, *, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1
    ):
        if batch_size % world_size:
            raise ValueError(f"batch_size={batch_size} must be divisible by the number of ranks ({world_size})")
        if num_rows < batch_size:
            raise ValueError(f"the split has {num_rows} rows, fewer than one batch (batch_size={batch_size})")
        self.num_rows, self.batch_size, self.shuffle, self.seed = num_rows, batch_size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.step = 0, 0  # where the next iteration starts

    def __len__(self) -> int:
        return self.num_rows // self.batch_size  # the last partial batch is dropped: every step has batch_size rows

    def resume_at(self, epoch: int, step_in_epoch: int) -> None:
        self.epoch, self.step = (epoch + 1, 0) if step_in_epoch >= len(self) else (epoch, step_in_epoch)

    def order(self, epoch: int) -> list[int]:
        return row_order(self.num_rows, epoch, shuffle=self.shuffle, seed=self.seed)

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        """Yields (epoch, step_in_epoch, row indices of this rank) for the rest of the current
        data epoch; the next iteration (Lightning's next epoch) starts the next data epoch."""
        epoch, first = self.epoch, self.step
        self.epoch, self.step = epoch + 1, 0
        order = self.order(epoch)
        per_rank = self.batch_size // self.world_size
        for step in range(first, len(self)):
            rows = order[step * self.batch_size : (step + 1) * self.batch_size]
            yield epoch, step, rows[self.rank * per_rank : (self.rank + 1) * per_rank]


def row_order(num_rows: int, epoch: int, *, shuffle: bool, seed: int) -> list[int]:
    """The rows of data epoch `epoch` in training order: a pure function of (seed, epoch), so a
    position in it is all a resumed run needs (shared by the static and the replay sources)."""
    if not shuffle:
        return list(range(num_rows))
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_rows, generator=gen).tolist()
