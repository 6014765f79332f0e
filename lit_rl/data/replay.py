"""Replay: rows of a static dataset mixed into the batches of a rollout run.

`ReplaySource` is the YAML face of one static source in a `RolloutDataModule`'s
`replay` list (a GRPO or OPD run that keeps training on SFT rows, say). Its rows
are rendered exactly like `StaticDataModule`'s (assistant-only masks, same
formats and columns) and always feed the cross-entropy loss, normalised by their
own token count (see `lit_rl.data.mixing`).

`ReplayStream` hands out the rows on rank 0, which shares them out with the
rollouts: an epoch's order is a pure function of (seed, epoch), so the number of
rows handed out so far is all a resumed run needs to continue without skipping
or repeating a row. `ReplayMix` holds a data module's replay sources together:
their options, streams, the split of each batch and the resume positions.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from lightning.pytorch.utilities import rank_zero_info

from lit_rl.data.mixing import Part, describe_split, part_unit, split_batch
from lit_rl.data.samples import Sample
from lit_rl.data.sampler import row_order
from lit_rl.data.steps import BadRowError, RowRenderer, open_row_renderer
from lit_rl.errors import ConfigError
from lit_rl.run_seed import order_seed, saved_order_seed

log = logging.getLogger(__name__)

BAD_ROW_POLICIES = ("error", "skip")


@dataclass
class ReplaySource:
    """One static dataset mixed into a rollout run.

    Args:
        path: hub dataset name, local json/jsonl/parquet/csv file, or a ``save_to_disk`` directory.
        weight: sampling weight against the rollouts' `data.weight` and the other replay sources:
            each batch gives this source ``batch_size x weight / total weight`` samples (rounded).
        name: the source's name in metrics (``train/<name>/loss``) and traces.
        group_size: must be 1 (a static row has one completion); unset means 1 whatever
            `data.group_size` the rollouts use.
        split, subset: which split of a hub dataset.
        messages_column, prompt_column, completion_column, tools_column: the columns, as in
            `StaticDataModule`.
        max_examples: use only the first N rows.
        max_length: longer rows are cut to this many tokens.
        shuffle: a new row order each pass over the data, drawn from `seed`.
        seed: the shuffle seed; unset: the run's ``seed_everything`` (a resumed run keeps the
            order it started with; lit_rl/run_seed.py).
        bad_rows: ``error`` stops at a bad row naming it; ``skip`` logs it and takes the next.
    """

    path: str
    weight: float = 1.0
    name: str = "replay"
    group_size: int | None = None
    split: str = "train"
    subset: str | None = None
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    tools_column: str = "tools"
    max_examples: int | None = None
    max_length: int = 2048
    shuffle: bool = True
    seed: int | None = None
    bad_rows: str = "error"

    def problems(self, where: str) -> list[str]:
        """What is wrong with these options, each naming the field as `where.field`."""
        problems = []
        if not self.weight > 0:
            problems.append(f"{where}.weight must be > 0, got {self.weight}")
        if self.group_size is not None and self.group_size != 1:
            problems.append(f"{where}.group_size is {self.group_size}, but a static dataset has one completion per "
                            "row: leave it unset (it is 1 whatever data.group_size says) or set it to 1")
        if self.bad_rows not in BAD_ROW_POLICIES:
            problems.append(f"{where}.bad_rows must be one of {BAD_ROW_POLICIES}, got {self.bad_rows!r}")
        if not self.name or "/" in self.name:
            problems.append(f"{where}.name must be a non-empty name without '/', got {self.name!r}")
        return problems

    def open(self, *, tokenizer: str, chat_template_kwargs: dict | None, trust_remote_code: bool,
             problems: list[str], where: str) -> ReplayStream | None:
        columns = {"messages_column": self.messages_column, "prompt_column": self.prompt_column,
                   "completion_column": self.completion_column, "tools_column": self.tools_column}
        renderer = open_row_renderer(
            self.path, split=self.split, subset=self.subset, data_files=None, max_examples=self.max_examples,
            columns=columns, tokenizer=tokenizer, max_length=self.max_length, trust_remote_code=trust_remote_code,
            chat_template_kwargs=chat_template_kwargs, bad_rows=self.bad_rows, problems=problems,
            what=f"{where} ({self.path})",
        )
        return None if renderer is None else ReplayStream(self, renderer)


class ReplayStream:
    """A replay source's rows, rendered, in a resumable order (rank 0 draws them)."""

    def __init__(self, source: ReplaySource, renderer: RowRenderer):
        self.source, self.renderer = source, renderer
        self.num_rows = len(renderer.rows)
        self.drawn = 0  # rows handed out (or skipped) so far, over all epochs: the resume position
        self.skipped = 0
        self.seed = order_seed(source.seed, None, flag="seed")  # the saved one replaces it on resume
        self._order: tuple[int, list[int]] | None = None  # (epoch, its row order), cached

    def _row(self, position: int) -> int:
        epoch = position // self.num_rows
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, row_order(self.num_rows, epoch, shuffle=self.source.shuffle, seed=self.seed))
        return self._order[1][position % self.num_rows]

    def take(self, n: int) -> list[Sample]:
        """The next `n` rows as samples (`metadata["row"]` is the row index)."""
        samples, bad_in_a_row = [], 0
        while len(samples) < n:
            index = self._row(self.drawn)
            self.drawn += 1
            try:
                sample = self.renderer.sample(index)
            except BadRowError as e:
                if self.source.bad_rows != "skip":
                    raise BadRowError(f"replay source {self.source.name!r}: {e} (set its bad_rows: skip to skip "
                                      "such rows)") from e
                self.skipped += 1
                bad_in_a_row += 1
                if bad_in_a_row >= self.num_rows:
                    raise BadRowError(f"replay source {self.source.name!r}: no row of {self.source.path} can be "
                                      "trained on") from e
                log.warning("replay source %r: skipping %s", self.source.name, e)
                continue
            bad_in_a_row = 0
            samples.append(dataclasses.replace(sample, metadata={"row": index}))
        return samples

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "skipped": self.skipped, "seed": self.seed, "num_rows": self.num_rows,
                "shuffle": self.source.shuffle}

    def load_state_dict(self, state: dict, where: str = "data.replay[0]") -> None:
        """The checkpoint's position, in the same rows in the same order: with another number of rows (another
        file, `max_examples`) or `shuffle`, position `drawn` would be other rows, some trained twice and some
        never, without a word. `where` is the source's flag prefix, e.g. ``data.replay[0]``."""
        problems = []
        if state.get("num_rows") not in (None, self.num_rows):
            problems.append(f"the checkpoint's run drew from {state['num_rows']} rows, this one has {self.num_rows} "
                            f"({where}.path, {where}.max_examples)")
        if state.get("shuffle") not in (None, self.source.shuffle):
            problems.append(f"the checkpoint's run had {where}.shuffle {state['shuffle']}, this one {self.source.shuffle}")
        if problems:
            raise ConfigError(f"cannot resume replay source {self.source.name!r} where the checkpoint left it: "
                              f"{'; '.join(problems)}. The rows it trained would not be found again: resume with the "
                              "same data, or train a fresh run in another trainer.default_root_dir")
        self.drawn, self.skipped = int(state["drawn"]), int(state.get("skipped", 0))
        saved = saved_order_seed(state, self.source.seed) if self.source.shuffle else None
        self.seed = order_seed(self.source.seed, saved, flag=f"{where}.seed")
        self._order = None


class ReplayMix:
    """The replay sources of one rollout data module: their options, their streams (rank 0 draws
    from them), how each batch splits between the rollouts and them, and their resume positions."""

    def __init__(self, sources: list[ReplaySource], *, rollout_name: str, rollout_weight: float):
        self.sources, self.rollout_name, self.rollout_weight = list(sources), rollout_name, rollout_weight
        self.streams: dict[str, ReplayStream] = {}  # by source name, opened in `open`
        self.split: list[tuple[Part, int]] | None = None  # (source, samples per batch), the rollouts first
        self._saved: dict | None = None

    def __bool__(self) -> bool:
        return bool(self.sources)

    def problems(self) -> list[str]:
        """What is wrong with the options (no I/O), each naming its field."""
        problems = []
        if not self.rollout_weight > 0:
            problems.append(f"data.weight must be > 0, got {self.rollout_weight}")
        names = [self.rollout_name]
        for i, source in enumerate(self.sources):
            if not isinstance(source, ReplaySource):
                problems.append(f"data.replay[{i}] must be a ReplaySource (path, weight, name, ...), got "
                                f"{type(source).__name__}")
                continue
            problems += source.problems(f"data.replay[{i}]")
            if source.name in names:
                problems.append(f"data.replay[{i}].name {source.name!r} is already the name of another source "
                                f"({names}); give each source its own name")
            names.append(source.name)
        return problems

    def layout_problems(self, micro_batch_tokens: int, packing: str, pack_length: int | None) -> list[str]:
        """Replay sources whose rows may be longer than a micro-batch (or a packed row) holds: such a
        row would stop the run at the step that draws it, so it is refused at start-up, as
        `StaticDataModule` refuses its own `max_length`."""
        problems = []
        for i, source in enumerate(self.sources):
            if not isinstance(source, ReplaySource):
                continue
            if source.max_length > micro_batch_tokens:
                problems.append(f"data.replay[{i}].max_length ({source.max_length}) exceeds data.micro_batch_tokens "
                                f"({micro_batch_tokens}): a long row would not fit a micro-batch; lower it or raise the budget")
            elif packing == "packed" and pack_length is not None and source.max_length > pack_length:
                problems.append(f"data.replay[{i}].max_length ({source.max_length}) exceeds data.pack_length "
                                f"({pack_length}): a long row would not fit a packed row")
        return problems

    def open(self, *, tokenizer: str, chat_template_kwargs: dict | None, trust_remote_code: bool, rollout_loss: str,
             group_size: int, world_size: int, batch_size: int, problems: list[str]) -> None:
        """Open every source (a trial render of its first row) and fix the split of each batch;
        what fails is appended to `problems`."""
        for i, source in enumerate(self.sources):
            stream = source.open(tokenizer=tokenizer, chat_template_kwargs=chat_template_kwargs,
                                 trust_remote_code=trust_remote_code, problems=problems, where=f"data.replay[{i}]")
            if stream is not None:
                self.streams[source.name] = stream
        if self._saved:
            self._restore(self._saved)
        if problems:  # the split needs valid options and readable sources
            return
        parts = [Part(self.rollout_name, rollout_loss, self.rollout_weight, part_unit(group_size, world_size))]
        parts += [Part(s.name, "cross_entropy", s.weight, world_size) for s in self.sources]
        try:
            counts = split_batch(batch_size, parts)
        except ValueError as e:
            problems.append(str(e))
            return
        self.split = list(zip(parts, counts))
        rank_zero_info(f"RolloutDataModule: each batch of {batch_size}: {describe_split(parts, counts)}")

    def rollout_count(self, batch_size: int) -> int:
        """The rollouts' samples per batch: all of it, or their share beside the replay sources."""
        return self.split[0][1] if self.split else batch_size

    def take(self) -> dict[str, list[Sample]]:
        """Each replay source's rows of the next batch (rank 0)."""
        return {part.name: self.streams[part.name].take(count) for part, count in (self.split or [])[1:]}

    def state_dict(self) -> dict | None:
        if self.streams:
            return {name: stream.state_dict() for name, stream in self.streams.items()}
        return self._saved

    def load_state_dict(self, saved: dict | None) -> None:
        self._saved = saved
        if self.streams and saved:
            self._restore(saved)

    def _restore(self, saved: dict) -> None:
        missing = sorted(set(self.streams) - set(saved))
        if missing:
            raise ValueError(f"RolloutDataModule: the checkpoint has no position for replay source(s) {missing} "
                             f"(it has {sorted(saved)}); a run cannot gain replay sources on resume")
        for i, source in enumerate(self.sources):
            if getattr(source, "name", None) in self.streams:
                self.streams[source.name].load_state_dict(saved[source.name], where=f"data.replay[{i}]")
