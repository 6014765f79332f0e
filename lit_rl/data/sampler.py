"""StepBatchSampler: which rows make up each optimizer step, resumably.

One item of this sampler is one optimizer step's rows for this rank. Order is a
pure function of (seed, epoch), so the position (data epoch, rows of it trained) is all
the state a resumed run needs to continue without skipping or repeating a row. The
position counts rows, not steps, so a run resumed with another batch size goes on from
the same row.

The sampler counts data epochs itself instead of following Lightning's epoch number:
a checkpoint written when `max_steps` stops a run mid-epoch records Lightning's epoch
as finished, so a resumed run's Lightning epoch can be one ahead of the data.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class StepBatchSampler:
    def __init__(
        self, num_rows: int, batch_size: int, *, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
        keep_last: bool = False,
    ):
        """`keep_last` (validation): a last, smaller step holds the rows left over, so that every
        row is seen exactly once; its rows are shared over the ranks as evenly as they go, and a
        rank may get none (every rank still yields the step, so collectives line up)."""
        if batch_size % world_size:
            raise ValueError(f"batch_size={batch_size} must be divisible by the number of ranks ({world_size})")
        if num_rows < batch_size and not keep_last:
            raise ValueError(f"the split has {num_rows} rows, fewer than one batch (batch_size={batch_size})")
        self.num_rows, self.batch_size, self.shuffle, self.seed = num_rows, batch_size, shuffle, seed
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last
        self.epoch, self.start = 0, 0  # where the next iteration starts: data epoch, rows of it already trained

    def __len__(self) -> int:
        if self.keep_last:
            return (self.num_rows + self.batch_size - 1) // self.batch_size  # the last step may be short
        return self.num_rows // self.batch_size  # the last partial batch is dropped: every step has batch_size rows

    def resume_at(self, epoch: int, rows_done: int) -> None:
        """Go on with data epoch `epoch` after the first `rows_done` rows of its order (the next
        epoch when no whole step is left in it)."""
        left = self.num_rows - rows_done
        self.epoch, self.start = (epoch + 1, 0) if left < self.batch_size else (epoch, rows_done)

    def order(self, epoch: int) -> list[int]:
        return row_order(self.num_rows, epoch, shuffle=self.shuffle, seed=self.seed)

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        """Yields (epoch, rows of it trained once this step is, row indices of this rank) for the
        rest of the current data epoch; the next iteration (Lightning's next epoch) starts the
        next data epoch."""
        epoch, start = self.epoch, self.start
        self.epoch, self.start = epoch + 1, 0
        order = self.order(epoch)
        while start < self.num_rows:
            rows = order[start : start + self.batch_size]
            if len(rows) < self.batch_size and not self.keep_last:
                return  # the rows left over: every training step has batch_size rows
            start += len(rows)
            n, r, w = len(rows), self.rank, self.world_size  # n == batch_size, a multiple of w, but in a kept last step
            yield epoch, start, rows[r * n // w : (r + 1) * n // w]


def row_order(num_rows: int, epoch: int, *, shuffle: bool, seed: int) -> list[int]:
    """The rows of data epoch `epoch` in training order: a pure function of (seed, epoch), so a
    position in it is all a resumed run needs (shared by the static and the replay sources)."""
    if not shuffle:
        return list(range(num_rows))
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_rows, generator=gen).tolist()
