"""StaticDataModule: replays a static HF dataset for SFT.

Each batch it yields is one optimizer step: `batch_size` rows (split over ranks),
rendered with the chat template to assistant-only masks, packed into micro-batches
under `micro_batch_tokens`. See docs/data.md for formats and masking rules.
"""

from __future__ import annotations

import warnings
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_rl.data.sampler import StepBatchSampler
from lit_rl.data.sources import single_split_kind
from lit_rl.data.steps import RowRenderer, StepDataset, open_row_renderer
from lit_rl.data.workers import resolve_num_workers
from lit_rl.errors import ConfigError
from lit_rl.run_seed import order_seed, saved_order_seed

PACKING_MODES = ("padded", "packed")
BAD_ROW_POLICIES = ("error", "skip")


def layout_problems(packing: str, micro_batch_tokens: int, pack_length: int | None) -> list[str]:
    """What is wrong with a step's layout options, the same for every data module: the packing
    mode, and a packed row longer than a micro-batch's token budget (it alone would break it)."""
    problems = []
    if packing not in PACKING_MODES:
        problems.append(f"data.packing must be one of {PACKING_MODES}, got {packing!r}")
    if packing == "packed" and pack_length is not None and pack_length > micro_batch_tokens:
        problems.append(f"data.pack_length ({pack_length}) exceeds data.micro_batch_tokens ({micro_batch_tokens}): "
                        "one packed row would break the micro-batch memory bound")
    return problems


def resolve_tokenizer_name(data_module: L.LightningDataModule) -> str:
    """The data module's own `tokenizer_name`, else its trainer's lit-rl model's: shared by the
    static and the rollout data modules. A tokenizer of the data's own that is not the model's must
    have the model's vocabulary (`check_same_vocabulary`)."""
    trainer = data_module.trainer
    module = trainer.lightning_module if trainer is not None else None
    name = getattr(module, "tokenizer_name", None)
    if data_module.tokenizer_name:
        if name and name != data_module.tokenizer_name and not getattr(data_module, "_vocabulary_checked", False):
            trust_model = bool(getattr(module, "trust_remote_code", False))  # the rollout data loads with the model's
            check_same_vocabulary(data_module.tokenizer_name, name, trust_model=trust_model,
                                  trust_data=bool(getattr(data_module, "trust_remote_code", trust_model)))
            data_module._vocabulary_checked = True
        return data_module.tokenizer_name
    if not name:
        raise ValueError(f"{type(data_module).__name__}: no tokenizer; set data.tokenizer or use a lit-rl model module")
    return name


def check_same_vocabulary(data_tokenizer: str, model_tokenizer: str, trust_data: bool, trust_model: bool) -> None:
    """Refuse a `data.tokenizer` whose vocabulary is not the model's: the data's token ids would be
    read by the model as other tokens (or index past its embeddings) and it would train on garbage
    without an error. Another tokenizer with the same vocabulary (another chat template, other
    special-token names in its config) is what `data.tokenizer` is for, and passes."""
    from lit_rl.model_names import load_tokenizer

    data = load_tokenizer(data_tokenizer, trust_remote_code=trust_data).get_vocab()
    model = load_tokenizer(model_tokenizer, trust_remote_code=trust_model).get_vocab()
    if data == model:
        return
    differ = sorted(set(data.items()) ^ set(model.items()), key=lambda item: item[1])
    token, index = differ[0]
    where = "the data's" if data.get(token) == index else "the model's"
    raise ConfigError(
        f"data.init_args.tokenizer {data_tokenizer!r} has another vocabulary than the model's tokenizer "
        f"{model_tokenizer!r} ({len(data)} and {len(model)} tokens; {len(differ)} (token, id) pairs are in one only, "
        f"the first {token!r} = {index} in {where}): the data's token ids would mean other tokens to the model. "
        "fix: leave data.tokenizer unset (the model's is used), or give one with the model's vocabulary"
    )


class StaticDataModule(L.LightningDataModule):
    def __init__(
        self,
        path: str,
        subset: str | None = None,
        split: str = "train",
        data_files: str | list[str] | None = None,
        val_path: str | None = None,
        val_split: str | None = None,
        messages_column: str = "messages",
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        tools_column: str = "tools",
        max_examples: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        batch_size: int = 32,
        micro_batch_tokens: int = 8192,
        packing: str = "padded",
        pack_length: int | None = None,
        max_length: int = 2048,
        bad_rows: str = "error",
        num_workers: int | Literal["auto"] = "auto",
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict | None = None,
    ):
        """
        Args:
            path: hub dataset name, local json/jsonl/parquet/csv file (globs allowed), or a
                ``save_to_disk`` directory.
            subset: hub dataset configuration name.
            split: split to train on (hub datasets; local files are one split).
            data_files: passed to ``datasets.load_dataset`` for hub-style loading.
            val_path: file(s) of a held-out split for ``validate`` and validation during fit.
            val_split: a split of ``path`` to validate on instead.
            messages_column: column with a list of chat messages.
            prompt_column: with ``completion_column``, the prompt/completion format (each cell
                a string or a list of messages); used when there is no messages column.
            completion_column: see ``prompt_column``.
            tools_column: optional column of tool definitions (OpenAI or bare function shape,
                or JSON text as in ``tool_defs`` columns).
            max_examples: use only the first N rows, of the training data and of the validation data each.
            shuffle: shuffle rows, with a new order each epoch drawn from ``seed``.
            seed: shuffle seed; None: the run's ``seed_everything`` (a resumed run keeps the
                order it started with; lit_rl/run_seed.py).
            batch_size: rows per optimizer step, over all ranks.
            micro_batch_tokens: token slots per micro-batch (rows x longest row); bounds memory.
            packing: ``padded`` (one sample per row, grouped by length) or ``packed`` (several
                samples per row, no attention across them).
            pack_length: row length in ``packed`` mode, at most ``micro_batch_tokens`` (its
                default).
            max_length: longer samples are cut to this many tokens (and counted as truncated).
            bad_rows: ``error`` stops at a bad row naming it; ``skip`` counts and logs it.
            num_workers: DataLoader worker processes that render the next steps. ``auto``: none
                (render inline) when training on CPU with torch on every core, where a worker
                would take a core from torch; otherwise 1 (lit_rl/data/workers.py).
            tokenizer: tokenizer name or path; defaults to the model's. Another one (another chat
                template) must have the model's vocabulary, or the run is refused before the model loads.
            trust_remote_code: allow tokenizer code from the hub. Off by default.
            chat_template_kwargs: extra variables for the chat template (e.g. enable_thinking).
        """
        super().__init__()
        self.path, self.subset, self.split, self.data_files = path, subset, split, data_files
        self.val_path, self.val_split = val_path, val_split
        self.columns = {
            "messages_column": messages_column,
            "prompt_column": prompt_column,
            "completion_column": completion_column,
            "tools_column": tools_column,
        }
        self.max_examples, self.shuffle, self.seed = max_examples, shuffle, seed
        self.batch_size, self.micro_batch_tokens, self.packing = batch_size, micro_batch_tokens, packing
        self.pack_length, self.max_length, self.bad_rows = pack_length, max_length, bad_rows
        resolve_num_workers(num_workers)  # a bad value fails here, before any data is read
        self.num_workers, self.tokenizer_name = num_workers, tokenizer
        self.trust_remote_code, self.chat_template_kwargs = trust_remote_code, chat_template_kwargs
        self._train: StepDataset | None = None
        self._val: StepDataset | None = None
        self._sampler: StepBatchSampler | None = None
        self._trained: tuple[int, int] | None = None  # (epoch, rows of it trained) after the last batch trained
        self._pending: tuple[tuple[int, int], int] | None = None  # (position, global_step when handed over)
        self._resume: tuple[int, int] | None = None  # (data epoch, rows of it trained) from a checkpoint
        self._saved_split: dict = {}  # the checkpoint's split: its rows and order, to resume in the same
        self._saved_seed: int | None = None  # the shuffle seed of the run a checkpoint resumes

    # ---- set-up and validation ---------------------------------------------------------------
    def option_problems(self) -> list[str]:
        problems = layout_problems(self.packing, self.micro_batch_tokens, self.pack_length)
        if self.bad_rows not in BAD_ROW_POLICIES:
            problems.append(f"data.bad_rows must be one of {BAD_ROW_POLICIES}, got {self.bad_rows!r}")
        if self.batch_size < 1:
            problems.append(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.max_length < 2:  # a prompt token and a trained one at least
            problems.append(f"data.max_length must be >= 2 tokens, got {self.max_length}")
        if self.max_length > self.micro_batch_tokens:
            problems.append(
                f"data.max_length ({self.max_length}) exceeds data.micro_batch_tokens ({self.micro_batch_tokens}): "
                "a long sample would not fit a micro-batch"
            )
        if self.packing == "packed" and self.pack_length is not None and self.pack_length < self.max_length:
            problems.append(f"data.pack_length ({self.pack_length}) must be >= data.max_length ({self.max_length})")
        if self.val_path and self.val_split:
            problems.append("give data.val_path or data.val_split, not both")
        elif self.val_split and (kind := single_split_kind(self.path)):
            problems.append(
                f"data.val_split ({self.val_split!r}) needs a source with named splits, but data.path {self.path!r} "
                f"is {kind}, one split only (it would validate on the training rows); give held-out rows as data.val_path"
            )
        return problems

    def resolve_tokenizer(self) -> str:
        return resolve_tokenizer_name(self)

    def _renderer(self, path: str, split: str, problems: list[str], what: str) -> RowRenderer | None:
        return open_row_renderer(
            path, split=split, subset=self.subset, data_files=self.data_files, max_examples=self.max_examples,
            columns=self.columns, tokenizer=self.resolve_tokenizer(), max_length=self.max_length,
            trust_remote_code=self.trust_remote_code, chat_template_kwargs=self.chat_template_kwargs,
            bad_rows=self.bad_rows, problems=problems, what=what,
        )

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None or self._val is not None:
            return
        problems = self.option_problems()
        world = self.trainer.world_size if self.trainer is not None else 1
        if world > 1 and self.batch_size % world:
            problems.append(f"data.batch_size ({self.batch_size}) must be divisible by the number of ranks ({world})")
        train = self._renderer(self.path, self.split, problems, "train data") if stage in (None, "fit") else None
        val_source = self.val_path or (self.path if self.val_split else None)
        val = None
        if val_source is not None and stage in (None, "fit", "validate"):
            val = self._renderer(val_source, self.val_split or "train", problems, "validation data")
        if stage == "validate" and val_source is None:
            problems.append("validate needs held-out data: set data.val_path or data.val_split")
        if train is not None and len(train.rows) < self.batch_size:
            problems.append(f"train data has {len(train.rows)} rows, fewer than data.batch_size ({self.batch_size})")
        if problems:
            raise ValueError("StaticDataModule: " + str(len(problems)) + " problem(s):\n  - " + "\n  - ".join(problems))
        make = lambda r, what: StepDataset(  # noqa: E731
            r, micro_batch_tokens=self.micro_batch_tokens, packing=self.packing, pack_length=self.pack_length,
            bad_rows=self.bad_rows, what=what,
        )
        self._train = make(train, f"train data ({self.path})") if train is not None else None
        self._val = make(val, f"validation data ({val_source})") if val is not None else None
        if train is not None:
            rank_zero_info(f"train data: {len(train.rows)} rows ({train.row_format}) from {self.path}")

    # ---- loaders -------------------------------------------------------------------------
    def _loader(self, dataset: StepDataset, sampler: StepBatchSampler) -> torch.utils.data.DataLoader:
        num_workers = resolve_num_workers(self.num_workers)  # now: the strategy may have set torch's threads
        return torch.utils.data.DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,  # each sampler item is a whole step; the dataset packs it
            collate_fn=_identity,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
        )

    def _rank(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        return self.trainer.global_rank, self.trainer.world_size

    def train_dataloader(self):
        rank, world = self._rank()
        self._sampler = StepBatchSampler(
            len(self._train.renderer.rows), self.batch_size, shuffle=self.shuffle,
            seed=self.shuffle_seed(announce=True), rank=rank, world_size=world,
        )
        if self._resume is not None:
            self._check_resumed_rows()
            self._sampler.resume_at(*self._resume)
        return self._loader(self._train, self._sampler)

    def _check_resumed_rows(self) -> None:
        """A resume goes on from a row of the checkpoint's split in its order, so it needs the same
        split in the same order (the batch size may change: the position counts rows)."""
        rows, saved = len(self._train.renderer.rows), self._saved_split
        problems = []
        if saved.get("num_rows") not in (None, rows):
            problems.append(f"the checkpoint's run trained on {saved['num_rows']} rows, this one has {rows} "
                            "(data.path, data.max_examples)")
        if saved.get("shuffle") not in (None, self.shuffle):
            problems.append(f"the checkpoint's run had data.shuffle {saved['shuffle']}, this one {self.shuffle}")
        if problems:
            raise ConfigError(f"cannot resume the data where the checkpoint left it: {'; '.join(problems)}. The rows "
                              "it trained would not be found again: resume with the same data, or train a fresh run "
                              "in another trainer.default_root_dir")

    def val_dataloader(self):
        if self._val is None:
            return []
        rank, world = self._rank()
        rows = len(self._val.renderer.rows)  # every row once: the last step holds the rest, on some ranks none
        sampler = StepBatchSampler(rows, self.batch_size, shuffle=False, rank=rank, world_size=world, keep_last=True)
        return self._loader(self._val, sampler)

    # ---- data position for exact resume -------------------------------------------------------
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if self.trainer is not None and self.trainer.training:
            self._settle_pending()
            self._pending = (tuple(batch["position"]), self.trainer.global_step)
        return batch

    def _settle_pending(self) -> None:
        """A handed-over batch counts as trained only once its optimizer step has happened, so a
        run stopped in the middle of a step resumes with that step's rows, not after them."""
        if self._pending is not None and self.trainer is not None and self.trainer.global_step > self._pending[1]:
            self._trained, self._pending = self._pending[0], None

    def shuffle_seed(self, announce: bool = False) -> int:
        """`seed`, else the one a resumed run started with, else the run's seed (so that two seeds
        of a run see their rows in two orders): `lit_rl.run_seed.order_seed`."""
        return order_seed(self.seed, self._saved_seed if self.shuffle else None, flag="data.seed", announce=announce)

    def state_dict(self) -> dict:
        self._settle_pending()
        position = self._trained if self._trained is not None else self._resume
        if position is None:
            return {}
        split = {"num_rows": len(self._train.renderer.rows), "shuffle": self.shuffle} if self._train is not None else {}
        return {"epoch": position[0], "rows_in_epoch": position[1], "seed": self.shuffle_seed(), **split}

    def load_state_dict(self, state: dict) -> None:
        if state:
            if "rows_in_epoch" in state:
                rows_done = int(state["rows_in_epoch"])
            else:  # a checkpoint from before positions counted rows: steps of this run's batch size
                rows_done = int(state["step_in_epoch"]) * self.batch_size
            self._resume = (int(state["epoch"]), rows_done)
            self._saved_split = {k: state[k] for k in ("num_rows", "shuffle") if k in state}
            self._saved_seed = saved_order_seed(state, self.seed)
            # Lightning cannot see that this datamodule resumes mid-epoch by itself.
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")


def _identity(item):
    return item
