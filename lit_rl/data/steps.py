"""StepDataset: renders the rows of one optimizer step lazily and packs them.

Indexed by what StepBatchSampler yields, so a DataLoader worker renders and packs a
whole step (with the shared `build_step`) while the trainer runs the previous one.
Rows are rendered only when a step needs them: time to the first step does not depend
on the split's size.
"""

from __future__ import annotations

import logging

import datasets
import torch

from lit_rl.data.render import RenderError, render_messages
from lit_rl.data.rows import RowError, chat_from_row, completion_start
from lit_rl.data.samples import Sample
from lit_rl.data.step_builder import build_step
from lit_rl.model_names import load_tokenizer

log = logging.getLogger(__name__)


class BadRowError(ValueError):
    """A row that cannot be trained on; the message names its index and column."""


class RowRenderer:
    """Row index -> Sample, loading the tokenizer on first use (once per worker process)."""

    def __init__(
        self,
        rows: datasets.Dataset,
        *,
        tokenizer: str,
        row_format: str,
        columns: dict[str, str],
        max_length: int,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict | None = None,
    ):
        self.rows, self.tokenizer_name, self.row_format, self.columns = rows, tokenizer, row_format, columns
        self.max_length, self.trust_remote_code = max_length, trust_remote_code
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_name, trust_remote_code=self.trust_remote_code)
        return self._tokenizer

    def __getstate__(self):
        return {**self.__dict__, "_tokenizer": None}  # workers load their own copy

    def sample(self, index: int) -> Sample:
        row = self.rows[index]
        try:
            messages, tools = chat_from_row(row, format=self.row_format, **self.columns)
            rendered = render_messages(
                self.tokenizer,
                messages,
                tools,
                chat_template_kwargs=self.chat_template_kwargs,
                train_from=completion_start(row, format=self.row_format, **self.columns),
            )
        except RowError as e:
            raise BadRowError(f"row {index}, column {e.column!r}: {e.message}") from e
        except (RenderError, ValueError) as e:
            raise BadRowError(f"row {index}: {e}") from e
        ids, mask = rendered.input_ids, rendered.loss_mask
        truncated = len(ids) > self.max_length
        if not any(mask[1 : self.max_length]):
            raise BadRowError(f"row {index}: no assistant token to train on within max_length={self.max_length}")
        return Sample(input_ids=ids[: self.max_length], loss_mask=mask[: self.max_length], truncated=truncated)


class StepDataset(torch.utils.data.Dataset):
    def __init__(self, renderer: RowRenderer, *, micro_batch_tokens: int, packing: str, pack_length: int | None, bad_rows: str):
        self.renderer, self.micro_batch_tokens, self.packing = renderer, micro_batch_tokens, packing
        self.pack_length, self.bad_rows = pack_length, bad_rows

    def __getitem__(self, item: tuple[int, int, list[int]]) -> dict:
        epoch, step, indices = item
        samples, skipped = [], 0
        for index in indices:
            try:
                samples.append(self.renderer.sample(index))
            except BadRowError as e:
                if self.bad_rows != "skip":
                    raise BadRowError(f"{e} (set data bad_rows: skip to skip such rows)") from e
                skipped += 1
                log.warning("skipping %s", e)
        built = build_step(samples, micro_batch_tokens=self.micro_batch_tokens, packing=self.packing, pack_length=self.pack_length)
        stats = {**built["stats"], "skipped_rows": float(skipped)}
        return {"micro_batches": built["micro_batches"], "stats": stats, "position": (epoch, step)}
