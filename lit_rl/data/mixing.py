"""Mixed sources: how one optimizer step's samples split between sources, and how they are laid out.

A run can draw each batch from several sources: the rollouts (the policy's samples for
GRPO/OPD, or a teacher's for SFT) plus static replay rows. Two decisions live here, both
pure functions:

- `split_batch`: how many samples each source gives every batch. Proportional to the
  sampling weights, rounded so that each source's count is a whole number of its groups
  and splits evenly over ranks, and the same in every step. A fixed split, rather than a
  random draw per sample, means every loss part has tokens in every step, so each part's
  normaliser (its own token count over the step) is never zero.
- `build_mixed_step`: each source's samples are packed apart from the others, and every
  micro-batch is tagged with its source (`"part"`) and the loss its tokens feed
  (`"loss"`), so the module can compute each part's loss and divide it by that part's
  own token count over the whole optimizer step (`CausalLMModule.training_step`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lit_rl.data.packing import padding_fraction, token_slots
from lit_rl.data.samples import Sample
from lit_rl.data.step_builder import build_step

LOSS_KINDS = ("cross_entropy", "policy_gradient", "distillation")


@dataclass(frozen=True)
class Part:
    """One source of a mixed step."""

    name: str  # in metrics: train/<name>/...
    loss: str  # the loss its tokens feed, one of LOSS_KINDS
    weight: float  # sampling weight
    unit: int  # its count must be a multiple of this: its group size, and of the number of ranks


def part_unit(group_size: int, world_size: int) -> int:
    """A source's count must be whole groups and split evenly over ranks."""
    return math.lcm(group_size, world_size)


def split_batch(batch_size: int, parts: Sequence[Part]) -> list[int]:
    """Samples each part gives every batch: the whole units summing to `batch_size` closest to
    `batch_size x weight / total` (least squares: a part rounds up where rounding every part down
    would leave no whole unit to fill the rest). Raises ValueError naming the batch size and the
    parts when no such split exists or the closest one gives a part nothing."""
    total = sum(p.weight for p in parts)
    ideal = [batch_size * p.weight / total for p in parts]
    described = ", ".join(f"{p.name} (weight {p.weight:g}, in multiples of {p.unit})" for p in parts)
    counts = _closest_split(batch_size, parts, ideal)
    if counts is None:
        raise ValueError(f"data.batch_size {batch_size} cannot be split between {described}: whole multiples leave "
                         "samples left over; choose a batch size that these multiples add up to")
    empty = [p.name for p, c in zip(parts, counts) if c == 0]
    if empty:
        raise ValueError(f"data.batch_size {batch_size} split between {described} gives {empty} no samples: "
                         "raise their weight or the batch size")
    return counts


def _closest_split(batch_size: int, parts: Sequence[Part], ideal: Sequence[float]) -> list[int] | None:
    """The counts (multiples of each part's unit) that sum to `batch_size` with the least squared
    distance to `ideal` (of two as close, the one with fewer empty parts), or None: a search over
    running sums."""
    best: dict[int, tuple[float, int, list[int]]] = {0: (0.0, 0, [])}
    for part, x in zip(parts, ideal):
        grown: dict[int, tuple[float, int, list[int]]] = {}
        for so_far, (cost, empty, counts) in best.items():
            for count in range(0, batch_size - so_far + 1, part.unit):
                key, option = so_far + count, (round(cost + (count - x) ** 2, 9), empty + (count == 0), counts + [count])
                if key not in grown or option[:2] < grown[key][:2]:
                    grown[key] = option
        best = grown
    return best[batch_size][2] if batch_size in best else None


def describe_split(parts: Sequence[Part], counts: Sequence[int]) -> str:
    """E.g. "policy 48 samples (policy_gradient), replay 16 samples (cross_entropy)"."""
    return ", ".join(f"{p.name} {c} samples ({p.loss})" for p, c in zip(parts, counts))


def build_mixed_step(parts: Sequence[tuple[Part, Sequence[Sample]]], *, micro_batch_tokens: int, packing: str,
                     pack_length: int | None = None) -> dict:
    """`build_step` per part, micro-batches tagged with ``"part"`` and ``"loss"``; the step's
    ``"parts"`` lists every part's ``(name, loss)`` (the same on every rank, even one that got
    no sample of a part). Stats add ``<name>/rows`` per part."""
    micro_batches, rows, stats = [], 0, {}
    truncated = 0.0
    for part, samples in parts:
        built = build_step(samples, micro_batch_tokens=micro_batch_tokens, packing=packing, pack_length=pack_length)
        for mb in built["micro_batches"]:
            mb["part"], mb["loss"] = part.name, part.loss
        micro_batches += built["micro_batches"]
        rows += len(samples)
        truncated += built["stats"]["truncated_rows"]
        stats[f"{part.name}/rows"] = float(len(samples))
    stats.update({
        "rows": float(rows),
        "micro_batches": float(len(micro_batches)),
        "truncated_rows": truncated,
        "padding_fraction": padding_fraction(micro_batches, sum(len(s) for _, ss in parts for s in ss)),
        "_token_slots": float(token_slots(micro_batches)),
    })
    return {"micro_batches": micro_batches, "stats": stats, "parts": [(p.name, p.loss) for p, _ in parts]}
