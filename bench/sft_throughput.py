#!/usr/bin/env python
"""SFT throughput on CPU: trained tokens per second of lit-rl, a plain PyTorch loop and TRL.

Trained tokens are the tokens with loss_mask True (assistant bodies and their <|im_end|>);
every contender trains exactly the same tokens of the same rows, in the same order, from the
same random init of the built-in tiny Qwen3, with AdamW (same lr, weight decay 0), gradient
clipping at 1.0 and the loss divided by the trained tokens of the whole optimizer step.

Contenders (``--contenders``, comma separated):
  lit_padded / lit_packed   lit-rl SFT through a real lightning.Trainer + StaticDataModule
                            (rows rendered lazily by DataLoader workers, ``--num-workers``).
  plain_padded / plain_packed
                            a bare PyTorch loop over the very micro-batches StaticDataModule
                            yields for the same steps, collected in memory beforehand: the
                            ceiling for framework overhead (no data loading, no Lightning).
  trl_padded                TRL SFTTrainer, padded batches (padding_free=False), attention mask.
  trl_padding_free          TRL SFTTrainer, padding_free=True: the step's rows flattened into one
                            sequence with restarting position_ids (TRL's packing=True with the
                            default "bfd" strategy uses this same padding-free layout).
TRL trains the same tokens through assistant_only_loss=True with the tiny model's own template
plus {% generation %} markers (checked token for token against lit-rl's masks before timing).

Timing: each contender runs ``--warmup`` + ``--steps`` optimizer steps; a timestamp is taken at
the end of every optimizer step (Lightning on_train_batch_end, TRL on_step_end, after
optimizer.step() in the plain loop). Throughput is the trained tokens of the measured steps over
the time from the end of the last warm-up step to the end of the last step, so data loading
and framework work between steps are included, set-up is not. Contenders run alternately in
``--rounds`` rounds and the medians are reported.

    .venv/bin/python bench/sft_throughput.py                      # defaults, ~4 min on 2 cores
    .venv/bin/python bench/sft_throughput.py --rounds 5 --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
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
from _data import TINY_MODEL, write_chats_jsonl  # noqa: E402

ALL_CONTENDERS = ("lit_padded", "lit_packed", "plain_padded", "plain_packed", "trl_padded", "trl_padding_free")
DEFAULT_CONTENDERS = "lit_padded,plain_padded,trl_padded,trl_padding_free,lit_packed"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contenders", default=DEFAULT_CONTENDERS, help=f"comma separated, of {ALL_CONTENDERS}")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps per run not timed (>= 1)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=32, help="rows (chats) per optimizer step")
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="lit-rl token slots per micro-batch")
    p.add_argument("--pack-length", type=int, default=None, help="lit-rl packed row length (default: micro-batch-tokens)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--num-workers", type=int, default=1, help="lit-rl DataLoader workers (the example config uses 1)")
    p.add_argument("--trl-micro-batch", type=int, default=None, help="TRL rows per forward (default: batch-size, no accumulation)")
    p.add_argument("--rows", type=int, default=None, help="rows in the data file (default: just enough for one run)")
    p.add_argument("--min-tokens", type=int, default=24, help="shortest rendered chat")
    p.add_argument("--max-tokens", type=int, default=120, help="longest rendered chat")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads for every contender (default: CPU count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait", type=float, default=20.0,
                   help="before each run, wait up to this many seconds for other processes to leave the CPU")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="a run during which other processes used more cores than this on average is redone")
    p.add_argument("--retries", type=int, default=2, help="redos of a disturbed run (the last try is kept anyway)")
    p.add_argument("--json", default=None, help="also write the JSON summary to this file")
    args = p.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in args.contenders if c not in ALL_CONTENDERS]
    if bad:
        p.error(f"unknown contenders {bad}; choose from {ALL_CONTENDERS}")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step's end starts the clock)")
    args.threads = args.threads or os.cpu_count()
    args.trl_micro_batch = args.trl_micro_batch or args.batch_size
    if args.batch_size % args.trl_micro_batch:
        p.error("--trl-micro-batch must divide --batch-size")
    args.total_steps = args.warmup + args.steps
    args.rows = args.rows or args.total_steps * args.batch_size
    if args.rows < args.total_steps * args.batch_size:
        p.error(f"--rows must be >= (warmup + steps) * batch-size = {args.total_steps * args.batch_size}")
    return args


# ---- timing ------------------------------------------------------------------------------------
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _tree_pids(root: int) -> list[int]:
    """root and its live descendants (DataLoader workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_snapshot() -> tuple[float, float] | None:
    """(CPU seconds busy on the whole machine, CPU seconds used by this process tree) so far.

    The difference over a window is what other processes took: this box is shared, and with
    torch using every core, a foreign process running at the same time slows a step a lot.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
        ours = 0
        for pid in _tree_pids(os.getpid()):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
                ours += int(stat[11]) + int(stat[12])  # utime + stime
            except (OSError, IndexError, ValueError):
                continue
        return busy / _HZ, ours / _HZ
    except OSError:  # not Linux
        return None


def foreign_cores(before, after, elapsed: float) -> float | None:
    """Average number of cores other processes kept busy between two snapshots."""
    if before is None or after is None or elapsed <= 0:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / elapsed


def wait_until_quiet(max_wait: float, threshold: float = 0.25, window: float = 1.0) -> float:
    """Wait (at most max_wait s) until other processes use < threshold cores; returns seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait:
        before = cpu_snapshot()
        time.sleep(window)
        load = foreign_cores(before, cpu_snapshot(), window)
        if load is None or load < threshold:
            break
    return time.perf_counter() - start


class StepClock:
    """Timestamp and trained tokens at the end of every optimizer step."""

    def __init__(self, warmup: int, total: int):
        self.snapshot_at = {warmup, total}  # CPU accounting only where the timed window starts and ends
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.slots: list[int] = []  # token slots fed to the model (incl. padding)
        self.micro_batches: list[int] = []
        self.threads: set[int] = set()
        self.cpu: dict[int, tuple | None] = {}

    def tick(self, tokens: int, slots: int, micro_batches: int) -> None:
        import torch

        self.times.append(time.perf_counter())
        if len(self.times) in self.snapshot_at:
            self.cpu[len(self.times)] = cpu_snapshot()
        self.tokens.append(int(tokens))
        self.slots.append(int(slots))
        self.micro_batches.append(int(micro_batches))
        self.threads.add(torch.get_num_threads())

    def result(self, warmup: int) -> dict:
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
            "foreign_cores": foreign_cores(self.cpu.get(warmup), self.cpu.get(len(self.times)), elapsed),
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
    from lit_rl.modules.model_loading import load_causal_lm

    return load_causal_lm(TINY_MODEL, random_init=True, seed=args.seed)


def _datamodule(args, data_path, packing, num_workers):
    from lit_rl.data.datamodules import StaticDataModule

    return StaticDataModule(
        data_path,
        batch_size=args.batch_size,
        micro_batch_tokens=args.micro_batch_tokens,
        packing=packing,
        pack_length=args.pack_length,
        max_length=args.max_length,
        num_workers=num_workers,
        tokenizer=TINY_MODEL,
        shuffle=False,  # the file is already in random order; TRL reads it sequentially too
        seed=args.seed,
    )


def run_lit(args, data_path, packing, workdir) -> StepClock:
    import lightning as L
    import torch

    from lit_rl.modules.sft import SFT

    torch.set_num_threads(args.threads)
    clock = StepClock(args.warmup, args.total_steps)

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.tick(*_batch_counts(batch["micro_batches"]))

    module = SFT(model=TINY_MODEL, random_init=True, optimizer=_adamw(args), max_grad_norm=1.0)
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
    trainer.fit(module, datamodule=_datamodule(args, data_path, packing, args.num_workers))
    return clock


def collect_batches(args, data_path, packing) -> list[dict]:
    """The batches StaticDataModule yields for the first total_steps steps (no Trainer, no workers)."""
    dm = _datamodule(args, data_path, packing, num_workers=0)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(args.total_steps)]


def run_plain(args, batches) -> StepClock:
    import torch

    from lit_rl.losses import masked_cross_entropy_sum

    torch.set_num_threads(args.threads)
    clock = StepClock(args.warmup, args.total_steps)
    model = _model(args)
    optimizer = _adamw(args)(model.parameters())
    for batch in batches:
        micro_batches = batch["micro_batches"]
        counts = _batch_counts(micro_batches)
        optimizer.zero_grad(set_to_none=True)
        for mb in micro_batches:
            logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
            loss_sum = masked_cross_entropy_sum(logits, mb["input_ids"], mb["loss_mask"])
            (loss_sum / max(counts[0], 1)).backward()
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


def run_trl(args, data_path, padding_free, workdir) -> StepClock:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    clock = StepClock(args.warmup, args.total_steps)
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

    rows = datasets.load_dataset("json", data_files=data_path, split="train")
    rows = rows.select(range(args.total_steps * args.batch_size))
    config = SFTConfig(
        output_dir=os.path.join(workdir, "trl"),
        max_steps=args.total_steps,
        per_device_train_batch_size=args.trl_micro_batch,
        gradient_accumulation_steps=args.batch_size // args.trl_micro_batch,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        # TRL defaults that are wrong for a CPU throughput run: bf16 autocast, gradient checkpointing
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
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
    )
    trainer = CountingSFTTrainer(
        model=_model(args), args=config, train_dataset=rows, processing_class=trl_tokenizer(), callbacks=[Clock()]
    )
    torch.set_num_threads(args.threads)
    trainer.train()
    return clock


# ---- driver ------------------------------------------------------------------------------------
def _quiet():
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def summarize(args, runs: dict[str, list[dict]], elapsed: float, rows_checked: int) -> dict:
    contenders = {}
    for name, results in runs.items():
        tps = [r["tokens_per_s"] for r in results]
        contenders[name] = {
            "tokens_per_s_median": statistics.median(tps),
            "tokens_per_s_runs": [round(x, 1) for x in tps],
            # cores other processes kept busy during each timed window (the machine is shared)
            "foreign_cores_runs": [None if r["foreign_cores"] is None else round(r["foreign_cores"], 2) for r in results],
            "step_s_median": statistics.median(r["step_s"] for r in results),
            "trained_tokens_per_step": results[0]["trained_tokens_per_step"],
            "slots_per_step": results[0]["slots_per_step"],
            # token slots fed to the model (prompt, padding included) per trained token: the waste of a layout
            "slots_per_trained_token": results[0]["slots_per_step"] / results[0]["trained_tokens_per_step"],
            "micro_batches_per_step": results[0]["micro_batches_per_step"],
            "torch_threads": sorted({t for r in results for t in r["torch_threads"]}),
        }
    step_tokens = {name: results[0]["step_tokens"] for name, results in runs.items()}
    same_tokens = len({tuple(v) for v in step_tokens.values()}) == 1

    def best(prefix):
        names = [n for n in contenders if n.startswith(prefix)]
        return max(names, key=lambda n: contenders[n]["tokens_per_s_median"]) if names else None

    lit, plain, trl_best = best("lit_"), best("plain_"), best("trl_")
    ratios, targets = {}, {}
    if lit and f"plain_{lit[4:]}" in contenders:
        same_batches = f"plain_{lit[4:]}"
        ratios["lit_vs_plain"] = contenders[lit]["tokens_per_s_median"] / contenders[same_batches]["tokens_per_s_median"]
        ratios["lit_vs_plain_pair"] = [lit, same_batches]
        targets["lit_ge_0.85x_plain"] = ratios["lit_vs_plain"] >= 0.85
    if lit and trl_best:
        ratios["lit_vs_trl_best"] = contenders[lit]["tokens_per_s_median"] / contenders[trl_best]["tokens_per_s_median"]
        ratios["lit_vs_trl_pair"] = [lit, trl_best]
        targets["lit_ge_1.5x_trl"] = ratios["lit_vs_trl_best"] >= 1.5
    if "lit_padded" in contenders and "lit_packed" in contenders:
        ratios["lit_padded_vs_packed"] = contenders["lit_padded"]["tokens_per_s_median"] / contenders["lit_packed"]["tokens_per_s_median"]
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
            for k in ("rounds", "warmup", "steps", "batch_size", "micro_batch_tokens", "pack_length", "max_length",
                      "num_workers", "trl_micro_batch", "rows", "min_tokens", "max_tokens", "lr", "threads", "seed",
                      "quiet_wait")
        },
        "same_trained_tokens_every_step": same_tokens,
        "trl_mask_rows_checked": rows_checked,
        "contenders": contenders,
        "best": {"lit": lit, "plain": plain, "trl": trl_best},
        "ratios": ratios,
        "targets_met": targets,
        "wall_s": round(elapsed, 1),
    }


def markdown(summary: dict) -> str:
    lines = [
        "| contender | trained tok/s (median) | runs | s/step | trained tok/step | slots/step | slots per trained tok "
        "| micro-batches/step | other procs' cores per run |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, c in summary["contenders"].items():
        lines.append(
            f"| {name} | {c['tokens_per_s_median']:.0f} | {', '.join(f'{x:.0f}' for x in c['tokens_per_s_runs'])} | "
            f"{c['step_s_median']:.3f} | {c['trained_tokens_per_step']:.0f} | {c['slots_per_step']:.0f} | "
            f"{c['slots_per_trained_token']:.2f} | {c['micro_batches_per_step']:.1f} | "
            f"{', '.join('?' if x is None else f'{x:.2f}' for x in c['foreign_cores_runs'])} |"
        )
    r = summary["ratios"]
    if "lit_vs_plain" in r:
        lines.append(f"\n{r['lit_vs_plain_pair'][0]} / {r['lit_vs_plain_pair'][1]}: **{r['lit_vs_plain']:.2f}x** (target >= 0.85x)")
    if "lit_vs_trl_best" in r:
        lines.append(f"\n{r['lit_vs_trl_pair'][0]} / {r['lit_vs_trl_pair'][1]}: **{r['lit_vs_trl_best']:.2f}x** (target >= 1.5x)")
    if "lit_padded_vs_packed" in r:
        lines.append(f"\nlit_padded / lit_packed: {r['lit_padded_vs_packed']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="lit_rl_bench_sft_")
    os.environ["HF_DATASETS_CACHE"] = os.path.join(workdir, "hf_datasets")  # keep Arrow caches out of ~/.cache
    try:
        _quiet()
        import torch

        torch.set_num_threads(args.threads)
        data_path = write_chats_jsonl(
            os.path.join(workdir, "chats.jsonl"), args.rows, seed=args.seed, min_tokens=args.min_tokens, max_tokens=args.max_tokens
        )
        rows_checked = check_trl_masks(args, data_path) if any(c.startswith("trl_") for c in args.contenders) else 0
        plain_batches = {
            mode: collect_batches(args, data_path, mode) for mode in ("padded", "packed") if f"plain_{mode}" in args.contenders
        }
        runs: dict[str, list[dict]] = {name: [] for name in args.contenders}
        for rnd in range(args.rounds):
            for name in args.contenders:
                kind, mode = name.split("_", 1)
                for attempt in range(args.retries + 1):
                    waited = wait_until_quiet(args.quiet_wait)
                    t0 = time.perf_counter()
                    if kind == "lit":
                        clock = run_lit(args, data_path, mode, workdir)
                    elif kind == "plain":
                        clock = run_plain(args, plain_batches[mode])
                    else:
                        clock = run_trl(args, data_path, mode == "padding_free", workdir)
                    result = clock.result(args.warmup)
                    busy = result["foreign_cores"]
                    disturbed = busy is not None and busy > args.max_foreign
                    print(
                        f"round {rnd + 1}/{args.rounds} {name:17s} {result['tokens_per_s']:8.0f} trained tok/s "
                        f"({result['step_s']:.3f} s/step, run {time.perf_counter() - t0:.1f} s, waited {waited:.0f} s "
                        f"for a quiet CPU, other processes used {'?' if busy is None else f'{busy:.2f}'} cores"
                        + (", redo)" if disturbed and attempt < args.retries else ")"),
                        file=sys.stderr,
                        flush=True,
                    )
                    if not disturbed:
                        break
                result["attempts"] = attempt + 1
                runs[name].append(result)
        summary = summarize(args, runs, time.perf_counter() - start, rows_checked)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary, indent=2))
    print()
    print(markdown(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
