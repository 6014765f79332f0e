"""Packing samples into micro-batches under a token budget.

Two layouts share one builder:
- `padded`: one sample per row, rows padded on the right to the longest row of the
  micro-batch (samples are grouped by length first, so little is padded).
- `packed`: several samples per row, up to `pack_length` tokens, with `position_ids`
  restarting at each document. transformers turns restarting position ids into a
  block-diagonal causal mask (forward with `use_cache=False` and no attention mask),
  so no token attends across documents.
A micro-batch holds rows while `rows * longest_row <= micro_batch_tokens`.
Right padding needs no attention mask: causal attention never lets a real token see
the padding after it, and padding is never a target. The padding continues the
positions of its row's last document rather than starting a document of its own, so
a padded-layout micro-batch looks unpacked to transformers, which then runs plain
causal attention with no mask at all (about 4% faster steps on CPU than the
block-diagonal mask a restart would cause; same losses).

Every micro-batch also carries `sequence_ids`: each token's sample index in the list
given to `pack_micro_batches` (-1 on padding), so an RL loss can aggregate per sequence
inside a packed row. The per-token RL fields of Sample (`logprobs`, `advantages`,
`teacher_logprobs`) come along as float32 tensors of the same shape, but only when some
sample of the call has them: an SFT step carries no RL tensors. The top-k fields of a teacher
server (`teacher_topk_ids`, `teacher_topk_logprobs`: k values per token) come along the same way as
`[rows, width, k]` tensors (long and float32; 0 on padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lit_rl.data.samples import PER_TOKEN_FIELDS, PER_TOKEN_TOPK_FIELDS, Sample

PAD_ID = 0  # any id works: padded slots are never targets and come after every real token of their row
Indexed = tuple[int, Sample]  # (index in the list given to pack_micro_batches, sample)


def _rows_padded(samples: Sequence[Indexed]) -> list[list[Indexed]]:
    return [[s] for s in sorted(samples, key=lambda s: len(s[1]), reverse=True)]


def _rows_packed(samples: Sequence[Indexed], pack_length: int) -> list[list[Indexed]]:
    """First-fit decreasing: few rows, each at most `pack_length` tokens."""
    rows: list[list[Indexed]] = []
    room: list[int] = []
    for s in sorted(samples, key=lambda s: len(s[1]), reverse=True):
        n = len(s[1])
        for i, free in enumerate(room):
            if n <= free:
                rows[i].append(s)
                room[i] -= n
                break
        else:
            rows.append([s])
            room.append(pack_length - n)
    return rows


def _to_tensors(rows: list[list[Indexed]], fields: Sequence[str], topk: int = 0) -> dict[str, torch.Tensor]:
    width = max(sum(len(s) for _, s in row) for row in rows)
    shape = (len(rows), width)
    per_token_topk = {name: torch.zeros((*shape, topk), dtype=torch.long if name.endswith("_ids") else torch.float32)
                      for name in (PER_TOKEN_TOPK_FIELDS if topk else ())}  # [rows, width, k]; 0 on padding
    input_ids = torch.full(shape, PAD_ID, dtype=torch.long)  # [rows, width]
    position_ids = torch.zeros(shape, dtype=torch.long)  # [rows, width]
    loss_mask = torch.zeros(shape, dtype=torch.bool)  # [rows, width]
    sequence_ids = torch.full(shape, -1, dtype=torch.long)  # [rows, width]; -1 on padding
    per_token = {name: torch.zeros(shape, dtype=torch.float32) for name in fields}  # [rows, width]; 0 on padding
    for r, row in enumerate(rows):
        at, n = 0, 0
        for index, s in row:
            n = len(s)
            input_ids[r, at : at + n] = torch.tensor(s.input_ids)
            position_ids[r, at : at + n] = torch.arange(n)
            mask = torch.tensor(s.loss_mask, dtype=torch.bool)  # [n]
            mask[0] = False  # a document's first token has nothing of its own to be predicted from
            loss_mask[r, at : at + n] = mask
            sequence_ids[r, at : at + n] = index
            for name, tensor in per_token.items():
                values = getattr(s, name)
                if values is not None:  # a sample lacking the field keeps zeros
                    tensor[r, at : at + n] = torch.as_tensor(values, dtype=torch.float32)  # [n]
            for name, tensor in per_token_topk.items():
                values = getattr(s, name)
                if values is not None:
                    tensor[r, at : at + n] = torch.as_tensor(values, dtype=tensor.dtype)  # [n, k]
            at += n
        position_ids[r, at:] = torch.arange(n, n + width - at)  # padding: the last document's tail
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "sequence_ids": sequence_ids,
        **per_token,
        **per_token_topk,
    }


def _topk_width(samples: Sequence[Sample]) -> int:
    """The k of the samples' top-k fields (0 when none has them); one k per call."""
    widths = {len(s.teacher_topk_ids[0]) for s in samples if s.teacher_topk_ids}
    if len(widths) > 1:
        raise ValueError(f"samples with top-k fields of different k {sorted(widths)} cannot share a step")
    return widths.pop() if widths else 0


def pack_micro_batches(
    samples: Sequence[Sample], *, micro_batch_tokens: int, mode: str = "padded", pack_length: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Lay `samples` out as micro-batches of at most `micro_batch_tokens` slots each.

    Each micro-batch is a dict of `[rows, width]` tensors: `input_ids`, `position_ids`,
    `loss_mask` (first token of every document cleared), `sequence_ids` (index into
    `samples`, -1 on padding) and, when any sample has them, the float32 per-token fields
    `logprobs`, `advantages`, `teacher_logprobs` (0.0 on padding and for samples without), and
    `[rows, width, k]` `teacher_topk_ids` / `teacher_topk_logprobs` when samples have them.
    """
    if mode not in ("padded", "packed"):
        raise ValueError(f"packing mode must be 'padded' or 'packed', got {mode!r}")
    if not samples:
        return []
    longest = max(len(s) for s in samples)
    pack_length = pack_length or micro_batch_tokens
    if mode == "packed" and pack_length > micro_batch_tokens:  # one such row alone breaks the budget
        raise ValueError(f"pack_length={pack_length} exceeds micro_batch_tokens={micro_batch_tokens}")
    if longest > micro_batch_tokens or (mode == "packed" and longest > pack_length):
        raise ValueError(
            f"a sample of {longest} tokens does not fit micro_batch_tokens={micro_batch_tokens}"
            + (f" / pack_length={pack_length}" if mode == "packed" else "")
            + "; raise the budget or lower max_length"
        )
    indexed = list(enumerate(samples))
    rows = _rows_padded(indexed) if mode == "padded" else _rows_packed(indexed, pack_length)
    fields = [name for name in PER_TOKEN_FIELDS if any(getattr(s, name) is not None for s in samples)]
    topk = _topk_width(samples)
    batches, current, width = [], [], 0
    for row in rows:  # rows come longest first, so `width` is set by the first row of each batch
        row_len = sum(len(s) for _, s in row)
        if current and (len(current) + 1) * max(width, row_len) > micro_batch_tokens:
            batches.append(_to_tensors(current, fields, topk))
            current, width = [], 0
        current.append(row)
        width = max(width, row_len)
    batches.append(_to_tensors(current, fields, topk))
    return batches


def token_slots(micro_batches: Sequence[dict[str, torch.Tensor]]) -> int:
    """The micro-batches' size in tokens, padding included."""
    return sum(mb["input_ids"].numel() for mb in micro_batches)


def padding_fraction(micro_batches: Sequence[dict[str, torch.Tensor]], real_tokens: int) -> float:
    slots = token_slots(micro_batches)
    return 0.0 if slots == 0 else 1.0 - real_tokens / slots
