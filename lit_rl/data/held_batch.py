"""Several optimizer steps on one rollout batch (`GRPO(updates_per_batch=U)`, TRL's
`num_iterations`): the batch held between its steps, with the trust region's "old" logprobs.

Batch k feeds steps kU .. kU + U - 1, each an update on the whole batch. The ratio of PPO's
clipped objective compares the current weights to those of the batch's first update, so
each micro-batch carries an `OldLogprobs` slot: the first update fills it with the detached
logprobs of its own forward (the same numbers a separate no-grad pass over the same weights
would give, so that pass is saved), the later updates read it. The step's micro-batches are
built once and reused, so every update sees the same layout.

A checkpoint in the middle of a batch (every N steps, or a SIGTERM) keeps the batch's samples
and every rank's old logprobs as plain data (`state_dict`, a collective: Lightning dumps a
checkpoint on every rank), so a resumed run finishes the batch exactly as an uninterrupted one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lit_rl.data.rank_share import from_wire, to_wire


class OldLogprobs:
    """One micro-batch's logprobs [B, T] under the weights of its batch's first update. A plain
    object (not a tensor, dict or dataclass), so Lightning's batch transfer hands the same slot
    to every update of the batch instead of copying it."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor | None = None) -> None:
        self.value = value


def old_logprobs(micro_batch: dict, logprobs: torch.Tensor, update: int) -> torch.Tensor:
    """The "old" logprobs of the clipped ratio: this forward's own at a batch's first update
    (kept in the micro-batch's slot for the later ones), the slot's at the later updates. A
    micro-batch without a slot (one update per batch, or a stand-in) is its own old policy."""
    slot = micro_batch.get("old_logprobs")
    if slot is None:
        return logprobs.detach()
    if update == 0:
        slot.value = logprobs.detach().clone()
    elif slot.value is None:
        raise RuntimeError(f"update {update} of a batch whose first update was never trained: no old logprobs")
    return slot.value.to(device=logprobs.device, dtype=logprobs.dtype)


class HeldBatch:
    """The batch whose updates are under way: its first step, its payload (samples, staleness,
    replay rows, metrics) and, once built, this rank's step with one `OldLogprobs` per micro-batch."""

    def __init__(self, first_step: int, payload: dict, restored: list | None = None) -> None:
        self.first_step, self.payload = first_step, payload
        self.step: dict | None = None
        self._restored = restored  # every rank's old logprobs from a checkpoint, until the step is built

    def hold(self, step: dict, rank: int, world_size: int) -> dict:
        """Keep this rank's built step and give each micro-batch its slot (filled from the
        checkpoint when the batch was resumed mid-way)."""
        slots = [OldLogprobs() for _ in step["micro_batches"]]
        if self._restored is not None:
            if len(self._restored) != world_size:
                raise ValueError(f"the checkpoint stopped in the middle of a batch trained by {len(self._restored)} "
                                 f"rank(s); resume it with as many (this run has {world_size})")
            mine = self._restored[rank]
            if len(mine) != len(slots):
                raise ValueError(f"the checkpoint's batch had {len(mine)} micro-batch(es) on rank {rank}, its rebuild "
                                 f"{len(slots)}: resume with the same data.micro_batch_tokens, packing and pack_length")
            for slot, values, mb in zip(slots, mine, step["micro_batches"]):
                slot.value = torch.tensor(values, dtype=torch.float32).reshape(mb["input_ids"].shape)
            self._restored = None
        for mb, slot in zip(step["micro_batches"], slots):
            mb["old_logprobs"] = slot
        self.step = step
        return step

    def state_dict(self, world_size: int, keep_old: bool = True) -> dict:
        """Plain data: the samples as dicts and every rank's old logprobs as lists (a collective
        under several ranks: every rank must call it). `keep_old` False: no old logprobs (a step
        that failed at the batch's first update, whose resume computes them again)."""
        if not keep_old:
            return {"first_step": self.first_step, "payload": to_wire(self.payload), "old_logprobs": None}
        if self.step is None:  # restored and not yet trained: what the checkpoint had
            return {"first_step": self.first_step, "payload": to_wire(self.payload), "old_logprobs": self._restored}
        mine = [[] if mb["old_logprobs"].value is None else mb["old_logprobs"].value.float().flatten().tolist()
                for mb in self.step["micro_batches"]]
        ranks = [mine]
        if world_size > 1:
            ranks = [None] * world_size
            dist.all_gather_object(ranks, mine)
        return {"first_step": self.first_step, "payload": to_wire(self.payload), "old_logprobs": ranks}

    @classmethod
    def from_state(cls, state: dict) -> HeldBatch:
        return cls(state["first_step"], from_wire(state["payload"]), restored=state["old_logprobs"])
