#!/usr/bin/env python
"""SFT throughput on CPU: trained tokens per second of lit-rl, a plain PyTorch loop and TRL.

Trained tokens are the tokens with loss_mask True (assistant bodies and their <|im_end|>).
Every contender trains exactly the same tokens of the same rows, in the same order (checked:
the trained tokens of every step are compared across contenders), from the same random init
of the built-in tiny Qwen3 (3.2M parameters), with AdamW (same lr, weight decay 0), gradient
clipping at 1.0 and the loss divided by the trained tokens of the whole optimizer step.

Contenders (``--contenders``: comma separated ``kind_layout[/key=value...]``):
  lit_padded, lit_packed      lit-rl SFT through a real lightning.Trainer + StaticDataModule
                              (rows rendered lazily by DataLoader workers).
  plain_padded, plain_packed  a bare PyTorch loop over the very micro-batches StaticDataModule
                              yields for the same steps and settings, collected in memory
                              beforehand: the ceiling for framework overhead.
  trl_padded                  TRL SFTTrainer, padding_free=False (rows padded, attention mask).
  trl_padding_free            TRL SFTTrainer, padding_free=True: each micro-batch's rows are
                              flattened into ONE sequence with restarting position_ids (TRL's
                              packing=True with its default "bfd" strategy feeds the model the
                              same flattened layout).
  Options: mbt=<micro_batch_tokens> and pack=<pack_length> (lit/plain), workers=<num_workers>
  (lit: a number or auto, lit-rl's default), mb=<rows per forward> (TRL; the rest of the step's rows go to gradient accumulation),
  trldefaults=1 (TRL: keep SFTConfig's own bf16=True and gradient_checkpointing=True, which
  every other TRL run turns off because both slow a CPU down), compile=1 (all kinds:
  torch.compile the model with dynamic shapes: lit-rl SFT(torch_compile=True), the plain loop
  torch.compile(model, dynamic=True), TRL torch_compile=True; use --warmup 4 or more so the
  compilation falls into the warm-up), chunk=<head_chunk_size> (lit/plain: trained positions per
  chunk of the output head), fullhead=1 (plain: the head over every position, then the loss on
  the trained ones, as lit-rl did before the chunked head; the plain loop otherwise uses
  lit-rl's pure function `selected_cross_entropy_sum`: the same selected-positions trick).

Real vocabularies (``--vocab-size N``): the tiny model's body with an output head and embedding
of N rows (tied, random init); token ids still come from the byte-level tokenizer, which is
fine for timing. At 151,936 (Qwen3's vocabulary) the output head dominates the step.

Memory: every run is a fresh process (spawned), so its peak resident set (ru_maxrss) is its
own: the table gives the trainer process's peak and, for lit-rl, the largest DataLoader
worker's peak beside it. It also gives the resident set at the end of the last step: what the
process holds between steps (libraries, weights, optimizer state), the floor under its peak.
TRL trains the same tokens through assistant_only_loss=True, with the tiny model's own template
plus {% generation %} markers (checked token for token against lit-rl's masks before timing).

Timing: each run does ``--warmup`` + ``--steps`` optimizer steps; a timestamp is taken at the
end of every optimizer step (Lightning on_train_batch_end, TRL on_step_end, after
optimizer.step() in the plain loop). Throughput = trained tokens of the timed steps / time from
the end of the last warm-up step to the end of the last step: data loading and framework work
between steps count, set-up does not. Contenders run alternately, ``--rounds`` times, and the
medians are reported. Every contender uses ``--threads`` torch threads (default: all cores).

The machine may be shared, and with torch on every core one foreign busy process slows a step
down many times. Each run therefore first waits (``--quiet-wait``) for a quiet CPU, and a run
during which other processes took more than ``--max-foreign`` cores is stopped and redone (up
to ``--retries`` times, then that round has no number for it); the table lists the cores other
processes used during each kept run.

    .venv/bin/python bench/sft_throughput.py                      # defaults: ~3 min on 2 quiet cores
    .venv/bin/python bench/sft_throughput.py --rounds 5 --json out.json
    .venv/bin/python bench/sft_throughput.py --contenders lit_padded/mbt=512,lit_padded/mbt=512/workers=0
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    TINY_MODEL, cpu_snapshot, exit_on_sigterm, foreign_cores, report, resident_gb, tree_pids, wait_until_quiet,
    write_chats_jsonl,
)

KINDS = {"lit": ("padded", "packed"), "plain": ("padded", "packed"), "trl": ("padded", "padding_free")}
OPTIONS = {"mbt": "micro_batch_tokens", "pack": "pack_length", "workers": "num_workers", "mb": "trl_micro_batch",
           "trldefaults": "trl_own_defaults", "compile": "compile", "chunk": "head_chunk_size", "fullhead": "full_head"}
DEFAULT_CONTENDERS = ",".join([
    "lit_padded/mbt=512", "plain_padded/mbt=512", "trl_padded/mb=8",
    "lit_packed/mbt=1024/pack=256", "plain_packed/mbt=1024/pack=256", "trl_padding_free/mb=4",
    "lit_padded/mbt=2048", "lit_packed/mbt=2048", "trl_padded/mb=32", "trl_padding_free/mb=32",
])


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str  # the spec as given, e.g. lit_packed/mbt=1024/pack=256
    kind: str  # lit | plain | trl
    layout: str  # padded | packed | padding_free
    micro_batch_tokens: int
    pack_length: int | None
    num_workers: int | str  # a number or "auto" (lit-rl's default)
    trl_micro_batch: int
    trl_own_defaults: int = 0  # 1: keep SFTConfig's bf16=True and gradient_checkpointing=True (slow on CPU)
    compile: int = 0  # 1: torch.compile the model (lit: SFT(torch_compile=True); TRL: torch_compile=True)
    head_chunk_size: int = 1024  # lit/plain: trained positions per chunk of the output head
    full_head: int = 0  # plain: 1 = head over every position (no selected-positions trick)

    @property
    def batches_key(self) -> tuple:
        """What decides the micro-batches StaticDataModule yields (lit and plain with equal keys see equal batches)."""
        return self.layout, self.micro_batch_tokens, self.pack_length if self.layout == "packed" else None


def parse_contender(spec: str, args) -> Contender:
    head, *opts = spec.split("/")
    kind, _, layout = head.partition("_")
    if kind not in KINDS or layout not in KINDS[kind]:
        raise ValueError(f"unknown contender {head!r}: use one of " + ", ".join(f"{k}_{l}" for k in KINDS for l in KINDS[k]))
    values = {field: getattr(args, field, 0) for field in OPTIONS.values()}
    values["head_chunk_size"] = args.head_chunk_size
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in OPTIONS or not value:
            raise ValueError(f"{spec}: options are {sorted(OPTIONS)} as key=value")
        values[OPTIONS[key]] = value if key == "workers" and value == "auto" else int(value)
    if args.batch_size % values["trl_micro_batch"]:
        raise ValueError(f"{spec}: mb must divide --batch-size")
    if values["full_head"] and kind != "plain":
        raise ValueError(f"{spec}: fullhead=1 is an option of the plain loop only")
    return Contender(name=spec, kind=kind, layout=layout, **values)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contenders", default=DEFAULT_CONTENDERS, help="comma separated kind_layout[/key=value...]")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps per run not timed (>= 1)")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=32, help="rows (chats) per optimizer step")
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="lit-rl token slots per micro-batch (default of mbt=)")
    p.add_argument("--pack-length", type=int, default=None, help="lit-rl packed row length (default of pack=; None: micro-batch-tokens)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--num-workers", type=lambda v: v if v == "auto" else int(v), default="auto",
                   help="lit-rl DataLoader workers (default of workers=): a number, or auto (lit-rl's default: 0 on a "
                        "CPU-only machine with torch on every core, else 1)")
    p.add_argument("--trl-micro-batch", type=int, default=None, help="TRL rows per forward (default of mb=; None: batch-size)")
    p.add_argument("--rows", type=int, default=None, help="rows in the data file (default: just enough for one run)")
    p.add_argument("--min-tokens", type=int, default=24, help="shortest rendered chat")
    p.add_argument("--max-tokens", type=int, default=120, help="longest rendered chat")
    p.add_argument("--answer-share", type=float, default=None,
                   help="fraction of each chat's content in the (trained) answer; default: a random split per chat")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="rows of the output head and embedding (default: the tiny model's 320); e.g. 151936 (Qwen3)")
    p.add_argument("--head-chunk-size", type=int, default=1024, help="lit/plain head_chunk_size (default of chunk=)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads for every contender (default: CPU count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait", type=float, default=20.0,
                   help="before each run, wait up to this many seconds for other processes to leave the CPU")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="a run during which other processes used more cores than this on average is stopped and redone")
    p.add_argument("--retries", type=int, default=2,
                   help="redos of a run stopped as disturbed; when all tries are disturbed the round has no number for it")
    p.add_argument("--max-wall", type=float, default=480.0,
                   help="after this many seconds no further run starts (the summary covers what ran); quiet, the "
                        "defaults take ~3 min")
    p.add_argument("--json", default=None, help="also write the JSON summary to this file")
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the end of the last warm-up step starts the clock)")
    args.threads = args.threads or os.cpu_count()
    args.trl_micro_batch = args.trl_micro_batch or args.batch_size
    args.total_steps = args.warmup + args.steps
    args.rows = args.rows or args.total_steps * args.batch_size
    if args.rows < args.total_steps * args.batch_size:
        p.error(f"--rows must be >= (warmup + steps) * batch-size = {args.total_steps * args.batch_size}")
    try:
        args.contenders = [parse_contender(c.strip(), args) for c in args.contenders.split(",") if c.strip()]
    except ValueError as e:
        p.error(str(e))
    return args


# ---- timing ------------------------------------------------------------------------------------
class Disturbed(RuntimeError):
    """Other processes took more than --max-foreign cores during the timed window: the run is void."""


class StepClock:
    """Timestamp and trained tokens at the end of every optimizer step.

    From the end of the first step on, it also watches how much CPU other processes take and,
    when `abort_above` is set, stops a run they disturb (a 2-thread torch step slows down many
    times when a third runnable thread shares 2 cores) instead of finishing it for nothing.
    """

    def __init__(self, warmup: int, total: int, abort_above: float | None = None):
        self.warmup, self.total, self.abort_above = warmup, total, abort_above
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.slots: list[int] = []  # token slots fed to the model (incl. padding)
        self.micro_batches: list[int] = []
        self.threads: set[int] = set()
        self.last_resident_gb: float | None = None  # the resident set at the end of the latest step
        self._pids: list[int] | None = None
        self._cpu_first = self._cpu_start = self._cpu_end = None

    def tick(self, tokens: int, slots: int, micro_batches: int) -> None:
        import torch

        now = time.perf_counter()
        self.times.append(now)
        self.tokens.append(int(tokens))
        self.slots.append(int(slots))
        self.micro_batches.append(int(micro_batches))
        self.threads.add(torch.get_num_threads())
        self.last_resident_gb = resident_gb()
        step = len(self.times)
        if step == 1:
            self._pids = tree_pids()  # this process and its DataLoader workers, fixed from here on
            self._cpu_first = cpu_snapshot(self._pids)
        else:
            snapshot = cpu_snapshot(self._pids)
            if step == self.warmup:
                self._cpu_start = snapshot
            elif step > self.warmup:
                self._cpu_end = snapshot
            busy = foreign_cores(self._cpu_first, snapshot, now - self.times[0])  # since the end of step 1
            if self.abort_above is not None and busy is not None and busy > self.abort_above:
                raise Disturbed(f"other processes used {busy:.2f} cores during steps 2..{step}")
        if step == self.warmup == 1:
            self._cpu_start = self._cpu_first

    def result(self) -> dict:
        warmup = self.warmup
        if len(self.times) <= warmup:
            raise RuntimeError(f"only {len(self.times)} steps ran, fewer than warm-up + 1")
        elapsed = self.times[-1] - self.times[warmup - 1]
        tokens, slots = sum(self.tokens[warmup:]), sum(self.slots[warmup:])
        steps = len(self.times) - warmup
        return {
            "tokens_per_s": tokens / elapsed,
            "step_s": elapsed / steps,
            "trained_tokens_per_step": tokens / steps,
            "slots_per_step": slots / steps,
            "micro_batches_per_step": sum(self.micro_batches[warmup:]) / steps,
            "step_tokens": self.tokens,  # every step, warm-up included: equal across contenders
            "torch_threads": sorted(self.threads),
            "foreign_cores": foreign_cores(self._cpu_start, self._cpu_end, elapsed),
            # what the run holds between steps: libraries, weights, optimizer state (and gradients
            # where a trainer keeps them until the next step): the floor under its peak
            "step_end_rss_gb": self.last_resident_gb,
        }


def _batch_counts(micro_batches) -> tuple[int, int, int]:
    tokens = sum(int(mb["loss_mask"][:, 1:].sum()) for mb in micro_batches)
    slots = sum(mb["input_ids"].numel() for mb in micro_batches)
    return tokens, slots, len(micro_batches)


# ---- contenders --------------------------------------------------------------------------------
def _adamw(args):
    import torch

    return functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0)


def _model(args):
    """The seeded random init every contender starts from; with --vocab-size, the same body with
    an output head (tied to the embedding) of that many rows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_rl.modules.model_loading import load_causal_lm

    if args.vocab_size is None:
        return load_causal_lm(TINY_MODEL, random_init=True, seed=args.seed)
    config = AutoConfig.from_pretrained(TINY_MODEL)
    config.vocab_size = args.vocab_size
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()


def _datamodule(args, data_path, c: Contender, num_workers):
    from lit_rl.data.datamodules import StaticDataModule

    return StaticDataModule(
        data_path,
        batch_size=args.batch_size,
        micro_batch_tokens=c.micro_batch_tokens,
        packing=c.layout,
        pack_length=c.pack_length,
        max_length=args.max_length,
        num_workers=num_workers,
        tokenizer=TINY_MODEL,
        shuffle=False,  # the file is already in random order; TRL reads it sequentially too
        seed=args.seed,
    )


def run_lit(args, data_path, c: Contender, workdir, abort_above=None) -> StepClock:
    import lightning as L
    import torch

    from lit_rl.modules.sft import SFT

    torch.set_num_threads(args.threads)
    clock = StepClock(args.warmup, args.total_steps, abort_above)

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.tick(*_batch_counts(batch["micro_batches"]))

    module = SFT(model=TINY_MODEL, random_init=True, optimizer=_adamw(args), max_grad_norm=1.0, torch_compile=bool(c.compile),
                 head_chunk_size=c.head_chunk_size)
    module.model = _model(args)  # the same seeded init as the other contenders; configure_model keeps it
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.total_steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=workdir,
        callbacks=[Clock()],
    )
    trainer.fit(module, datamodule=_datamodule(args, data_path, c, c.num_workers))
    return clock


def collect_batches(args, data_path, c: Contender) -> list[dict]:
    """The batches StaticDataModule yields for the first total_steps steps (no Trainer, no workers)."""
    dm = _datamodule(args, data_path, c, num_workers=0)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(args.total_steps)]


def run_plain(args, batches, c: Contender, abort_above=None) -> StepClock:
    import torch

    from lit_rl.chunked_head import selected_cross_entropy_sum
    from lit_rl.losses import masked_cross_entropy_sum

    torch.set_num_threads(args.threads)
    clock = StepClock(args.warmup, args.total_steps, abort_above)
    model = _model(args)
    compiled = lambda m: torch.compile(m, dynamic=True) if c.compile else m  # noqa: E731
    forward, body, head = compiled(model), compiled(model.base_model), model.get_output_embeddings()
    optimizer = _adamw(args)(model.parameters())

    def loss_sum_of(mb):
        if c.full_head:  # logits of every position, the loss on the trained ones
            logits = forward(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
            return masked_cross_entropy_sum(logits, mb["input_ids"], mb["loss_mask"])
        hidden = body(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).last_hidden_state
        targets = mb["loss_mask"][:, 1:]
        return selected_cross_entropy_sum(hidden[:, :-1][targets], head.weight, mb["input_ids"][:, 1:][targets],
                                          chunk_size=c.head_chunk_size)

    for batch in batches:
        micro_batches = batch["micro_batches"]
        counts = _batch_counts(micro_batches)
        optimizer.zero_grad(set_to_none=True)
        for mb in micro_batches:
            (loss_sum_of(mb) / max(counts[0], 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        clock.tick(*counts)
    return clock


_HEADER = "{{- '<|im_start|>assistant\\n' }}\n"
_CLOSER = "{{- '<|im_end|>\\n' }}\n{%- elif message.role == 'tool' %}"


def trl_template(template: str) -> str:
    """The tiny model's template with {% generation %} around each assistant body + <|im_end|>."""
    if template.count(_CLOSER) != 1 or _HEADER not in template:
        raise RuntimeError("the tiny model's chat template changed; update trl_template()")
    template = template.replace(_HEADER, _HEADER + "{%- generation %}\n", 1)
    return template.replace(_CLOSER, "{{- '<|im_end|>' }}\n{%- endgeneration %}\n{{- '\\n' }}\n{%- elif message.role == 'tool' %}")


def trl_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.chat_template = trl_template(tok.chat_template)
    return tok


def check_trl_masks(args, data_path) -> int:
    """TRL's assistant mask == lit-rl's loss mask, token for token, on every row used. Returns rows checked."""
    from lit_rl.data.render import render_messages

    lit_tok = __import__("transformers").AutoTokenizer.from_pretrained(TINY_MODEL)
    tok = trl_tokenizer()
    n = 0
    with open(data_path) as f:
        for line in f:
            if n >= args.total_steps * args.batch_size:
                break
            messages = json.loads(line)["messages"]
            ours = render_messages(lit_tok, messages)
            theirs = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            if theirs["input_ids"] != ours.input_ids or [bool(m) for m in theirs["assistant_masks"]] != ours.loss_mask:
                raise RuntimeError(f"row {n}: TRL would train other tokens than lit-rl")
            n += 1
    return n


def run_trl(args, data_path, c: Contender, workdir, abort_above=None) -> StepClock:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    clock = StepClock(args.warmup, args.total_steps, abort_above)
    pending = {"tokens": 0, "slots": 0, "micro_batches": 0}

    class CountingSFTTrainer(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            # labels are -100 except on assistant tokens; a row's first token is never one
            pending["tokens"] += int((inputs["labels"] != -100).sum())
            pending["slots"] += inputs["input_ids"].numel()
            pending["micro_batches"] += 1
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            clock.tick(pending["tokens"], pending["slots"], pending["micro_batches"])
            pending.update(tokens=0, slots=0, micro_batches=0)

    padding_free = c.layout == "padding_free"
    rows = datasets.load_dataset("json", data_files=data_path, split="train")
    rows = rows.select(range(args.total_steps * args.batch_size))
    config = SFTConfig(
        output_dir=os.path.join(workdir, "trl"),
        max_steps=args.total_steps,
        per_device_train_batch_size=c.trl_micro_batch,
        gradient_accumulation_steps=args.batch_size // c.trl_micro_batch,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        # SFTConfig defaults that slow a CPU down (bf16 autocast, gradient checkpointing): off unless asked
        **({} if c.trl_own_defaults else {"bf16": False, "gradient_checkpointing": False}),
        fp16=False,
        use_cpu=True,
        # padding_free without packing refuses to truncate; every row is shorter than max_length anyway
        max_length=None if padding_free else args.max_length,
        assistant_only_loss=True,
        padding_free=padding_free,
        train_sampling_strategy="sequential",  # the same rows per step as lit-rl (shuffle=False)
        dataloader_num_workers=0,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
        torch_compile=bool(c.compile),
    )
    trainer = CountingSFTTrainer(
        model=_model(args), args=config, train_dataset=rows, processing_class=trl_tokenizer(), callbacks=[Clock()]
    )
    torch.set_num_threads(args.threads)
    trainer.train()
    return clock


# ---- driver ------------------------------------------------------------------------------------
def _one_run(args, data_path, c: Contender, workdir, abort_above) -> dict:
    """One timed run, in the fresh process `run_in_fresh_process` made for it."""
    import resource

    _quiet()
    try:
        if c.kind == "lit":
            clock = run_lit(args, data_path, c, workdir, abort_above)
        elif c.kind == "plain":
            clock = run_plain(args, collect_batches(args, data_path, c), c, abort_above)
        else:
            clock = run_trl(args, data_path, c, workdir, abort_above)
    except Exception as e:  # Lightning and TRL may wrap what a callback raises
        cause = e
        while cause is not None and not isinstance(cause, Disturbed):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return {"disturbed": str(cause)}
    kib = 1024 / 1e9  # ru_maxrss is in KiB on Linux
    return {
        **clock.result(),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib,
        # the largest finished child's peak: lit-rl's DataLoader worker (0 when there is none)
        "children_peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib,
    }


def run_in_fresh_process(args, data_path, c: Contender, workdir, abort_above) -> dict:
    """Each run in a process of its own (spawned, not forked): its peak memory is its own, and
    nothing one contender allocated or imported stays to flatter or burden the next."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_one_run, args, data_path, c, workdir, abort_above).result()


def _quiet():
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def _median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(args, runs: dict[Contender, list[dict]], elapsed: float, rows_checked: int) -> dict:
    contenders = {}
    for c, all_results in runs.items():
        results = [r for r in all_results if r is not None]  # None: every try of that round was disturbed
        if not results:
            contenders[c.name] = {"tokens_per_s_median": None, "rounds_without_result": len(all_results)}
            continue
        tps = [r["tokens_per_s"] for r in results]
        first = results[0]
        contenders[c.name] = {
            "tokens_per_s_median": statistics.median(tps),
            "tokens_per_s_runs": [round(x, 1) for x in tps],
            "rounds_without_result": len(all_results) - len(results),
            # cores other processes kept busy during each timed window (the machine may be shared)
            "foreign_cores_runs": [None if r["foreign_cores"] is None else round(r["foreign_cores"], 2) for r in results],
            "attempts_runs": [r["attempts"] for r in results],
            "step_s_median": statistics.median(r["step_s"] for r in results),
            "trained_tokens_per_step": first["trained_tokens_per_step"],
            "slots_per_step": first["slots_per_step"],
            # token slots fed to the model (prompt and padding included) per trained token: the waste of a layout
            "slots_per_trained_token": first["slots_per_step"] / first["trained_tokens_per_step"],
            "micro_batches_per_step": first["micro_batches_per_step"],
            "torch_threads": sorted({t for r in results for t in r["torch_threads"]}),
            "peak_rss_gb_runs": [round(r["peak_rss_gb"], 3) for r in results],
            "peak_rss_gb_median": statistics.median(r["peak_rss_gb"] for r in results),
            "step_end_rss_gb_median": _median_or_none(r["step_end_rss_gb"] for r in results),
            "worker_peak_rss_gb_median": statistics.median(r["children_peak_rss_gb"] for r in results),
            "settings": {k: v for k, v in dataclasses.asdict(c).items() if k != "name"},
        }
    step_tokens = {tuple(r["step_tokens"]) for rs in runs.values() for r in rs if r is not None}
    same_tokens = len(step_tokens) == 1 if step_tokens else None
    tps = {name: v["tokens_per_s_median"] for name, v in contenders.items()}
    runs = {c: rs for c, rs in runs.items() if tps[c.name] is not None}

    def best(kind, layout=None):
        names = [c.name for c in runs if c.kind == kind and (layout is None or c.layout == layout)]
        return max(names, key=tps.get) if names else None

    comparisons = []
    for c in runs:  # lit-rl against the plain loop over the very same batches
        twin = next((d for d in runs if d.kind == "plain" and c.kind == "lit" and d.batches_key == c.batches_key
                     and not d.full_head and d.head_chunk_size == c.head_chunk_size and d.compile == c.compile), None)
        if twin is not None:
            comparisons.append({"what": "lit_vs_plain_same_batches", "a": c.name, "b": twin.name, "ratio": tps[c.name] / tps[twin.name]})
    lit, trl_best = best("lit"), best("trl")
    if lit and trl_best:
        for t in [d for d in runs if d.kind == "trl"]:
            comparisons.append({"what": "best_lit_vs_trl", "a": lit, "b": t.name, "ratio": tps[lit] / tps[t.name]})
    for c in runs:  # what the selected-positions head buys the plain loop
        twin = next((d for d in runs if d.kind == "plain" and c.kind == "plain" and c.full_head and not d.full_head
                     and d.batches_key == c.batches_key), None)
        if twin is not None:
            comparisons.append({"what": "plain_selected_head_vs_full_head", "a": twin.name, "b": c.name,
                                "ratio": tps[twin.name] / tps[c.name]})
    lit_padded = best("lit", "padded")
    for c in runs:
        if c.kind == "lit" and c.layout == "packed" and lit_padded:
            comparisons.append({"what": "lit_padded_vs_packed", "a": lit_padded, "b": c.name, "ratio": tps[lit_padded] / tps[c.name]})
    thin = {name: len(v.get("tokens_per_s_runs", ())) < 2 for name, v in contenders.items()}
    for x in comparisons:  # a median of fewer than 2 undisturbed runs is a weak number
        x["reliable"] = not (thin[x["a"]] or thin[x["b"]])
    # The targets: of the SFT issue at the tiny vocabulary, of the real-vocabulary issue with --vocab-size.
    real_vocab = args.vocab_size is not None
    plain_bar, trl_bar, memory_bar = (0.95, 2.0, 0.5) if real_vocab else (0.85, 1.5, None)
    targets = {}
    lit_plain = [x for x in comparisons if x["what"] == "lit_vs_plain_same_batches"]
    if lit_plain:
        ours = next((x for x in lit_plain if x["a"] == lit), None) or min(lit_plain, key=lambda x: x["ratio"])
        targets[f"lit_ge_{plain_bar}x_plain"] = {
            "pair": [ours["a"], ours["b"]], "ratio": ours["ratio"], "met": ours["ratio"] >= plain_bar,
            "all_pairs_met": all(x["ratio"] >= plain_bar for x in lit_plain), "reliable": ours["reliable"]}
    if lit and trl_best:
        ratio = tps[lit] / tps[trl_best]
        targets[f"lit_ge_{trl_bar}x_trl"] = {"pair": [lit, trl_best], "ratio": ratio, "met": ratio >= trl_bar,
                                             "reliable": not (thin[lit] or thin[trl_best])}
        if memory_bar is not None:  # peak memory of lit-rl's fastest setting against TRL's fastest
            mem = {name: contenders[name]["peak_rss_gb_median"] for name in (lit, trl_best)}
            ratio = mem[lit] / mem[trl_best]
            targets[f"lit_peak_memory_le_{memory_bar}x_trl"] = {
                "pair": [lit, trl_best], "ratio": ratio, "met": ratio <= memory_bar,
                "reliable": not (thin[lit] or thin[trl_best]),
                # what lit-rl holds between steps against the bar: above it, no step could meet it
                "bar_gb": memory_bar * mem[trl_best], "lit_step_end_rss_gb": contenders[lit]["step_end_rss_gb_median"]}
    import lightning
    import torch
    import transformers
    import trl

    return {
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
        },
        "settings": {
            k: getattr(args, k)
            for k in ("rounds", "warmup", "steps", "batch_size", "max_length", "rows", "min_tokens", "max_tokens", "answer_share", "lr",
                      "vocab_size", "head_chunk_size", "threads", "seed", "quiet_wait", "max_foreign", "retries", "max_wall")
        },
        "same_trained_tokens_every_step": same_tokens,
        "trl_mask_rows_checked": rows_checked,
        "contenders": contenders,
        "best": {"lit": lit, "plain": best("plain"), "trl": trl_best},
        "comparisons": comparisons,
        "targets": targets,
        "wall_s": round(elapsed, 1),
    }


def markdown(summary: dict) -> str:
    lines = [
        "| contender | trained tok/s (median of undisturbed runs) | runs | s/step | trained tok/step | slots/step | slots per trained tok "
        "| micro-batches/step | peak RSS GB (worker) | RSS at step end GB | other procs' cores per run |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, c in summary["contenders"].items():
        if c["tokens_per_s_median"] is None:
            lines.append(f"| {name} | no number: every run disturbed (or none started) | | | | | | | | | |")
            continue
        worker = c["worker_peak_rss_gb_median"]
        lines.append(
            f"| {name} | {c['tokens_per_s_median']:.0f} | {', '.join(f'{x:.0f}' for x in c['tokens_per_s_runs'])} | "
            f"{c['step_s_median']:.3f} | {c['trained_tokens_per_step']:.0f} | {c['slots_per_step']:.0f} | "
            f"{c['slots_per_trained_token']:.2f} | {c['micro_batches_per_step']:.1f} | "
            f"{c['peak_rss_gb_median']:.2f}" + (f" ({worker:.2f})" if worker else "") + " | "
            + ("?" if c["step_end_rss_gb_median"] is None else f"{c['step_end_rss_gb_median']:.2f}") + " | "
            f"{', '.join('?' if x is None else f'{x:.2f}' for x in c['foreign_cores_runs'])} |"
        )
    lines.append("")
    warn = " (WEAK: fewer than 2 undisturbed runs on one side; other processes kept the CPU busy)"
    for x in summary["comparisons"]:
        lines.append(f"- {x['what']}: {x['a']} / {x['b']} = {x['ratio']:.2f}x" + ("" if x["reliable"] else warn))
    for name, t in summary["targets"].items():
        lines.append(f"- target {name}: {t['pair'][0]} / {t['pair'][1]} = **{t['ratio']:.2f}x** -> {'met' if t['met'] else 'NOT met'}"
                     + ("" if t["reliable"] else warn))
        floor = t.get("lit_step_end_rss_gb")
        if floor is not None:  # what lit-rl holds before a step adds its activations, logits and gradient buffers
            lines.append(f"  - {t['pair'][0]} holds {floor:.2f} GB at the end of a step (libraries, weights, "
                         f"AdamW state); the bar is {t['bar_gb']:.2f} GB")
    lines.append(f"- same trained tokens in every step for every contender: {summary['same_trained_tokens_every_step']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    exit_on_sigterm()
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="lit_rl_bench_sft_")
    os.environ["HF_DATASETS_CACHE"] = os.path.join(workdir, "hf_datasets")  # keep Arrow caches out of ~/.cache
    try:
        _quiet()
        import torch

        torch.set_num_threads(args.threads)
        data_path = write_chats_jsonl(
            os.path.join(workdir, "chats.jsonl"), args.rows, seed=args.seed, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
            answer_share=args.answer_share,
        )
        rows_checked = check_trl_masks(args, data_path) if any(c.kind == "trl" for c in args.contenders) else 0
        runs: dict[Contender, list[dict]] = {c: [] for c in args.contenders}
        out_of_time = False
        for rnd in range(args.rounds):
            for c in args.contenders:
                result = None
                for attempt in range(args.retries + 1):
                    if time.perf_counter() - start > args.max_wall:
                        if not out_of_time:
                            print(f"--max-wall {args.max_wall:.0f} s reached: no further runs", file=sys.stderr, flush=True)
                        out_of_time = True
                        break
                    waited = wait_until_quiet(args.quiet_wait)
                    abort_above = args.max_foreign  # a disturbed run is stopped early, not finished for nothing
                    t0 = time.perf_counter()
                    result = run_in_fresh_process(args, data_path, c, workdir, abort_above)
                    if "disturbed" in result:
                        print(f"round {rnd + 1}/{args.rounds} {c.name:30s} stopped: {result['disturbed']}", file=sys.stderr, flush=True)
                        continue
                    busy = result["foreign_cores"]
                    print(
                        f"round {rnd + 1}/{args.rounds} {c.name:30s} {result['tokens_per_s']:6.0f} trained tok/s "
                        f"({result['step_s']:.3f} s/step, peak RSS {result['peak_rss_gb']:.2f} GB, run "
                        f"{time.perf_counter() - t0:.1f} s, waited {waited:.0f} s "
                        f"for a quiet CPU, other processes used {'?' if busy is None else f'{busy:.2f}'} cores)",
                        file=sys.stderr,
                        flush=True,
                    )
                    result["attempts"] = attempt + 1
                    break
                if result is not None and "disturbed" in result:
                    result = None  # every try disturbed: this round has no number for it
                runs[c].append(result)
        summary = summarize(args, runs, time.perf_counter() - start, rows_checked)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report(summary, markdown, args.json)


if __name__ == "__main__":
    main()
