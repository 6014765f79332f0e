"""Group-relative advantages (GRPO): each sample's reward minus its group's mean reward.

The baseline is the mean reward of the other completions of the same prompt, so no value
model is needed. Dividing by a standard deviation is optional, because it is a choice with
known trade-offs (Dr. GRPO, Liu et al. 2025, argues the per-group std biases training toward
prompts that are too easy or too hard; the GRPO paper divides by it):

- ``"group"``: divide by the group's std (the GRPO paper).
- ``"batch"``: divide by the std of every reward in the batch (one scale for all prompts).
- ``"none"``: no division (Dr. GRPO).

Stds are population stds (ddof=0, so a group of one has std 0, not NaN), and the division is
by ``std + eps``: a group whose rewards are all equal gets advantage exactly 0, never NaN or
an eps-amplified rounding error. A group's advantages therefore always sum to 0. (TRL's
GRPOTrainer divides by the sample std + 1e-4: its advantages are about 1/1.07 of these in a
group of 8, a factor AdamW and gradient clipping mostly undo; docs/rl.md.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from lit_rl.data.samples import Sample

Scale = Literal["group", "batch", "none"]
SCALES = ("group", "batch", "none")


def std(values: Sequence[float]) -> float:
    """Population standard deviation (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def all_equal(rewards: Sequence[float]) -> bool:
    """True when every reward of a group is the same: its advantages are all 0, so it gives no
    learning signal (what `skip_zero_advantage` rejects)."""
    return all(r == rewards[0] for r in rewards)


def group_advantages(
    groups: Sequence[Sequence[float]], scale: Scale = "group", eps: float = 1e-6
) -> list[list[float]]:
    """Sequence-level advantages for each group of rewards: ``(r - mean(group)) / (std + eps)``
    with std per `scale` (see the module docstring); `"none"` is ``r - mean(group)``."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    batch_std = std([r for g in groups for r in g]) if scale == "batch" else 0.0
    out = []
    for rewards in groups:
        rewards = [float(r) for r in rewards]
        if not rewards or all_equal(rewards):
            out.append([0.0] * len(rewards))
            continue
        mean = sum(rewards) / len(rewards)
        divisor = {"group": std(rewards) + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        out.append([(r - mean) / divisor for r in rewards])
    return out


def with_group_advantages(
    samples: Sequence[Sample], group_size: int, scale: Scale = "group", eps: float = 1e-6
) -> list[Sample]:
    """Copies of `samples` (consecutive groups of `group_size`, as a batch holds them) whose
    per-token `advantages` carry their group-relative advantage on the loss_mask tokens and 0
    elsewhere (`Sample.with_advantage`). Every sample needs a reward."""
    if group_size < 1 or len(samples) % group_size:
        raise ValueError(f"{len(samples)} samples do not split into groups of {group_size}")
    missing = [i for i, s in enumerate(samples) if s.reward is None]
    if missing:
        raise ValueError(f"samples {missing[:10]} have no reward; advantages need one per sample")
    groups = [[s.reward for s in samples[i : i + group_size]] for i in range(0, len(samples), group_size)]
    advantages = [a for g in group_advantages(groups, scale, eps) for a in g]
    return [s.with_advantage(a) for s, a in zip(samples, advantages)]
