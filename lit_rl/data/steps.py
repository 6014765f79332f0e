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
from lit_rl.data.rows import RowError, chat_from_row, completion_start, detect_format
from lit_rl.data.samples import Sample
from lit_rl.data.sources import open_split
from lit_rl.data.step_builder import build_step
from lit_rl.errors import UserError
from lit_rl.model_names import load_tokenizer

log = logging.getLogger(__name__)


class BadRowError(UserError, ValueError):
    """A row that cannot be trained on; the message names its data (once it reaches `StepDataset`),
    its index and column. A user error: `lit-rl` prints the message, not a traceback."""


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


def with_causes(error: BaseException) -> str:
    """`Type: message` of an error and of what raised it: datasets' DatasetGenerationError says only
    "An error occurred while generating the dataset"; the row at fault is in its cause (pyarrow's
    "JSON parse error: ... in row 1")."""
    parts = []
    while error is not None and len(parts) < 4:
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__
    return parts[0] + "".join(f" (cause: {part})" for part in parts[1:])


def open_row_renderer(
    path: str, *, split: str, subset: str | None, data_files, max_examples: int | None, columns: dict[str, str],
    tokenizer: str, max_length: int, trust_remote_code: bool, chat_template_kwargs: dict | None, bad_rows: str,
    problems: list[str], what: str,
) -> RowRenderer | None:
    """A dataset split's rows, ready to render: loading, format detection and a trial render of
    row 0 (the template must be able to attribute tokens; find out now, not at step 1000).
    Problems are appended to `problems`, naming `what` (e.g. "train data"), so that a data
    module can report them together with its other option problems."""
    try:
        rows = open_split(path, subset=subset, split=split, data_files=data_files, max_examples=max_examples)
    except Exception as e:  # noqa: BLE001 - reported with the rest, naming the source
        problems.append(f"{what}: cannot load {path!r} (split {split!r}): {with_causes(e)}")
        return None
    if len(rows) == 0:
        problems.append(f"{what}: {path!r} split {split!r} has no rows")
        return None
    try:
        row_format = detect_format(rows.column_names, **{k: columns[k] for k in columns if k != "tools_column"})
    except ValueError as e:
        problems.append(f"{what}: {e}")
        return None
    renderer = RowRenderer(rows, tokenizer=tokenizer, row_format=row_format, columns=columns, max_length=max_length,
                           trust_remote_code=trust_remote_code, chat_template_kwargs=chat_template_kwargs)
    try:
        renderer.sample(0)
    except BadRowError as e:
        if isinstance(e.__cause__, RenderError) or bad_rows != "skip":
            problems.append(f"{what}: {e}")
    return renderer


class StepDataset(torch.utils.data.Dataset):
    def __init__(self, renderer: RowRenderer, *, micro_batch_tokens: int, packing: str, pack_length: int | None, bad_rows: str,
                 what: str = "data"):
        """`what` names the data in a bad row's error (``validation data (held_out.jsonl)``): "row 5" alone
        read as the training data's row 5."""
        self.renderer, self.micro_batch_tokens, self.packing = renderer, micro_batch_tokens, packing
        self.pack_length, self.bad_rows, self.what = pack_length, bad_rows, what

    def __getitem__(self, item: tuple[int, int, list[int]]) -> dict:
        epoch, rows_done, indices = item
        samples, skipped = [], 0
        for index in indices:
            try:
                samples.append(self.renderer.sample(index))
            except BadRowError as e:
                if self.bad_rows != "skip":
                    raise BadRowError(f"{self.what}: {e} (set data bad_rows: skip to skip such rows)") from e
                skipped += 1
                log.warning("skipping %s: %s", self.what, e)
        built = build_step(samples, micro_batch_tokens=self.micro_batch_tokens, packing=self.packing, pack_length=self.pack_length)
        stats = {**built["stats"], "skipped_rows": float(skipped)}
        return {"micro_batches": built["micro_batches"], "stats": stats, "position": (epoch, rows_done)}
