"""A rollout step from rank 0 to every rank: plain data over the wire, then each rank's share.

Under several ranks, rank 0 alone runs the rollout buffer; each step's samples are broadcast as
plain data (dicts, no pickled objects of ours) and every rank trains a contiguous, equal share
of each source's samples (their counts divide by the ranks; the data module checks it).
"""

from __future__ import annotations

from lit_rl.rollouts.buffer import sample_from_dict, sample_to_dict


def to_wire(payload: dict) -> dict:
    """A step's payload as plain data for a broadcast (samples as dicts); one without samples (a
    stop, rank 0's error) as it is."""
    if "samples" not in payload:
        return payload
    return {**payload, "samples": [sample_to_dict(s) for s in payload["samples"]],
            "replay": {k: [sample_to_dict(s) for s in v] for k, v in payload["replay"].items()}}


def from_wire(payload: dict) -> dict:
    if "samples" not in payload:
        return payload
    return {**payload, "samples": [sample_from_dict(d) for d in payload["samples"]],
            "replay": {k: [sample_from_dict(d) for d in v] for k, v in payload["replay"].items()}}


def rank_share(samples: list, rank: int, world: int) -> list:
    """Rank `rank`'s contiguous share of a source's samples (their count divides by the ranks)."""
    share = len(samples) // world
    return samples[rank * share:(rank + 1) * share]
