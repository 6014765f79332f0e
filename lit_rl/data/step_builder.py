"""build_step: a list of Samples -> one optimizer step's micro-batches and data stats.

A pure function shared by every data source (the static replayer today, rollouts next),
so that a step looks the same to the LightningModule whatever made its samples. Source-
specific stats (skipped rows, staleness, ...) are added by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

from lit_rl.data.packing import pack_micro_batches, padding_fraction, token_slots
from lit_rl.data.samples import Sample


def build_step(samples: Sequence[Sample], *, micro_batch_tokens: int, packing: str, pack_length: int | None = None) -> dict:
    """Pack `samples` and measure the step: `{"micro_batches": [...], "stats": {...}}`.

    `sequence_ids` in the micro-batches index into `samples`. Stats (floats, logged as
    `train/<name>`): `rows`, `micro_batches`, `truncated_rows`, `padding_fraction`; and
    `_token_slots` (the micro-batches' size, not logged: the step sums the counts and the padding
    over ranks with it, `TrainingStep`).
    """
    micro_batches = pack_micro_batches(samples, micro_batch_tokens=micro_batch_tokens, mode=packing, pack_length=pack_length)
    stats = {
        "rows": float(len(samples)),
        "micro_batches": float(len(micro_batches)),
        "truncated_rows": float(sum(s.truncated for s in samples)),
        "padding_fraction": padding_fraction(micro_batches, sum(len(s) for s in samples)),
        "_token_slots": float(token_slots(micro_batches)),
    }
    return {"micro_batches": micro_batches, "stats": stats}
