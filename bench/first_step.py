#!/usr/bin/env python
"""Time to the first optimizer step of `lit-rl fit` (SFT) against the dataset's size.

Writes jsonl datasets of short chats (default 1,000 and 1,000,000 rows) to a temp dir
under /tmp, then runs the real CLI (`python -m lit_rl.cli fit`, what the `lit-rl` entry
point runs) with max_steps=1 in fresh subprocesses and records wall-clock timestamps:

  launch      the parent starts the subprocess (process start)
  callbacks   the CLI has imported everything, parsed the config and built the callbacks
  data_ready  datamodule.setup() done (dataset opened, first row rendered as a check)
  first_batch the first step's batch came out of the DataLoader
  first_step  the first optimizer step ended (on_train_batch_end)
  exit        the process ended

`datasets` converts a json file to an Arrow cache the first time it opens it: O(rows),
once per file. Each size is therefore run first with an empty datasets cache (the
"cold" run pays the conversion) and then again with that cache warm; the conversion
is the difference of the setup phase, reported separately. The cache lives in the temp
dir, so the user's ~/.cache is never read or written; everything is removed at the end.
A throw-away run first warms the OS page cache with the libraries (not measured). Sizes
alternate; a run during which other processes kept more than ``--max-foreign`` cores busy
is redone (a cold one with its cache emptied again).

    .venv/bin/python bench/first_step.py                    # 1k and 1M rows, ~1.5 min on 2 quiet cores
    .venv/bin/python bench/first_step.py --sizes 1000,100000 --warm-runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from _common import REPO, TINY_MODEL, exit_on_sigterm, machine_busy_s, report, wait_until_quiet, write_chats_jsonl  # noqa: E402

CLOCK_ENV = "BENCH_FIRST_STEP_CLOCK"  # not LIT_RL_*: the CLI reads those as config overrides

try:  # the callback the child's config names as `first_step.FirstStepClock`
    import lightning as L

    class FirstStepClock(L.Callback):
        """Appends wall-clock timestamps of the first step's milestones to $BENCH_FIRST_STEP_CLOCK."""

        def __init__(self):
            self.path = os.environ[CLOCK_ENV]
            self._mark("callbacks")

        def _mark(self, name: str) -> None:
            with open(self.path, "a") as f:
                f.write(json.dumps({name: time.time()}) + "\n")

        def setup(self, trainer, pl_module, stage):  # Lightning runs it right after datamodule.setup()
            self._mark("data_ready")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                self._mark("first_batch")
                rows = int(batch["stats"]["rows"])
                with open(self.path, "a") as f:
                    f.write(json.dumps({"rows_in_step": rows}) + "\n")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                self._mark("first_step")

except ImportError:  # pragma: no cover - the parent does not need lightning
    pass


CONFIG = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  default_root_dir: {root}
  callbacks:
    - class_path: first_step.FirstStepClock
model:
  class_path: lit_rl.modules.SFT
  init_args:
    model: {model}
    random_init: true
    optimizer:
      class_path: torch.optim.AdamW
      init_args:
        lr: 0.001
data:
  class_path: lit_rl.data.datamodules.StaticDataModule
  init_args:
    path: {data}
    batch_size: {batch_size}
    micro_batch_tokens: 2048
    max_length: 128
    packing: padded
    num_workers: {num_workers}
"""

PHASES = ("callbacks", "data_ready", "first_batch", "first_step", "exit")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,1000000", help="dataset sizes in rows, comma separated")
    p.add_argument("--warm-runs", type=int, default=3, help="runs per size with the Arrow cache warm (median reported)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-workers", type=int, default=1, help="as in examples/reverse_text/sft.yaml")
    p.add_argument("--min-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64, help="short chats")
    p.add_argument("--timeout", type=float, default=600, help="per subprocess, seconds")
    p.add_argument("--json", default=None, help="also write the JSON summary to this file")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data, caches, configs)")
    p.add_argument("--quiet-wait", type=float, default=20.0,
                   help="before each run, wait up to this many seconds for other processes to leave the CPU")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="a run during which other processes used more cores than this on average is redone")
    p.add_argument("--retries", type=int, default=2, help="redos of a disturbed run (the last try is kept anyway)")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    return args


def run_child(workdir: str, data: str, cache: str, tag: str, args) -> dict:
    """One `lit-rl fit` with max_steps=1 in a fresh process; returns seconds since launch per phase."""
    config = os.path.join(workdir, f"{tag}.yaml")
    with open(config, "w") as f:
        f.write(CONFIG.format(root=os.path.join(workdir, "run_" + tag), model=TINY_MODEL, data=data,
                              batch_size=args.batch_size, num_workers=args.num_workers))
    clock = os.path.join(workdir, f"{tag}.clock.jsonl")
    env = {
        **os.environ,
        CLOCK_ENV: clock,
        "HF_DATASETS_CACHE": cache,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([BENCH, REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    waited = wait_until_quiet(args.quiet_wait)
    busy0, kids0 = machine_busy_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    launch = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "lit_rl.cli", "fit", "--config", config],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout,
    )
    end = time.time()
    busy1, kids1 = machine_busy_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"lit-rl fit failed ({tag}):\n{proc.stderr[-4000:]}")
    marks = {}
    with open(clock) as f:
        for line in f:
            marks.update(json.loads(line))
    out = {name: marks[name] - launch for name in PHASES[:-1] if name in marks}
    out["exit"] = end - launch
    out["rows_in_step"] = marks.get("rows_in_step")
    out["waited_for_quiet_s"] = waited
    if busy0 is not None:  # cores other processes (not this child and its workers) kept busy meanwhile
        ours = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
        out["foreign_cores"] = max(0.0, (busy1 - busy0) - ours) / (end - launch)
    return out


def run_measured(workdir: str, data: str, cache: str, tag: str, args, *, cold: bool) -> dict:
    """run_child, redone (with the cache emptied again for a cold run) while other processes disturbed it."""
    for attempt in range(args.retries + 1):
        if cold:
            shutil.rmtree(cache, ignore_errors=True)
        result = run_child(workdir, data, cache, f"{tag}_try{attempt}", args)
        result["attempts"] = attempt + 1
        if result.get("foreign_cores", 0.0) <= args.max_foreign:
            break
        print(f"  ({tag}: other processes used {result['foreign_cores']:.2f} cores, redo)", file=sys.stderr, flush=True)
    return result


def arrow_cache_bytes(cache: str) -> int:
    total = 0
    for root, _, files in os.walk(cache):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(".arrow"))
    return total


def main(argv=None) -> dict:
    args = parse_args(argv)
    exit_on_sigterm()
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="lit_rl_bench_first_step_", dir="/tmp")
    results: dict[int, dict] = {}
    try:
        files = {}
        for n in args.sizes:
            path = os.path.join(workdir, f"chats_{n}.jsonl")
            t0 = time.perf_counter()
            write_chats_jsonl(path, n, seed=0, min_tokens=args.min_tokens, max_tokens=args.max_tokens)
            files[n] = path
            results[n] = {"rows": n, "file_mb": os.path.getsize(path) / 2**20, "write_s": time.perf_counter() - t0, "warm": []}
            print(f"wrote {n} rows ({results[n]['file_mb']:.1f} MB) in {results[n]['write_s']:.1f} s", file=sys.stderr, flush=True)
        caches = {n: os.path.join(workdir, f"hf_datasets_{n}") for n in args.sizes}
        # prime the OS page cache with the libraries (and byte code) on a throw-away file: not measured
        prime = write_chats_jsonl(os.path.join(workdir, "prime.jsonl"), 64, seed=1)
        run_child(workdir, prime, os.path.join(workdir, "hf_datasets_prime"), "prime", args)
        # cold: an empty datasets cache, so this run converts the json file to Arrow
        for n in args.sizes:
            results[n]["cold"] = run_measured(workdir, files[n], caches[n], f"{n}_cold", args, cold=True)
            results[n]["arrow_cache_mb"] = arrow_cache_bytes(caches[n]) / 2**20
            print(f"{n} rows, cold cache: {json.dumps({k: round(v, 2) for k, v in results[n]['cold'].items() if v is not None})}",
                  file=sys.stderr, flush=True)
        for i in range(args.warm_runs):  # sizes alternate, so a busy moment does not hit one size only
            for n in args.sizes:
                r = run_measured(workdir, files[n], caches[n], f"{n}_warm{i}", args, cold=False)
                results[n]["warm"].append(r)
                print(f"{n} rows, warm cache #{i + 1}: {json.dumps({k: round(v, 2) for k, v in r.items() if v is not None})}",
                      file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    for n, r in results.items():
        warm = {p: statistics.median(w[p] for w in r["warm"]) for p in PHASES} if r["warm"] else {}
        r["warm_median"] = warm
        cold = r["cold"]
        # the setup phase (callbacks -> data_ready) is where `datasets` opens, or first converts, the file
        r["data_setup_cold_s"] = cold["data_ready"] - cold["callbacks"]
        if warm:
            r["data_setup_warm_s"] = warm["data_ready"] - warm["callbacks"]
            r["arrow_conversion_s"] = r["data_setup_cold_s"] - r["data_setup_warm_s"]
    sizes = sorted(results)
    small, large = sizes[0], sizes[-1]
    growth = None
    if len(sizes) > 1 and results[small]["warm_median"]:
        a, b = results[small]["warm_median"]["first_step"], results[large]["warm_median"]["first_step"]
        growth = {"small_rows": small, "large_rows": large, "first_step_small_s": a, "first_step_large_s": b,
                  "difference_s": b - a, "ratio": b / a}
    import datasets
    import lightning
    import torch

    summary = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "lightning": lightning.__version__, "datasets": datasets.__version__},
        "settings": {k: getattr(args, k) for k in ("sizes", "warm_runs", "batch_size", "num_workers", "min_tokens", "max_tokens",
                                                   "quiet_wait", "max_foreign", "retries")},
        "results": {str(n): results[n] for n in sizes},
        "warm_first_step_growth": growth,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    return report(summary, markdown, args.json)


def markdown(summary: dict) -> str:
    lines = [
        "| rows | file MB | cache | to callbacks (imports, CLI) | data setup | to first batch | **to end of first step** "
        "| process exit | other procs' cores |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for n, r in summary["results"].items():
        for label, t, runs in (("cold (first run)", r["cold"], [r["cold"]]),
                               (f"warm (median of {len(r['warm'])})", r["warm_median"], r["warm"])):
            if not t:
                continue
            busy = ", ".join(f"{x['foreign_cores']:.2f}" if "foreign_cores" in x else "?" for x in runs)
            lines.append(
                f"| {int(n):,} | {r['file_mb']:.1f} | {label} | {t['callbacks']:.2f} s | {t['data_ready'] - t['callbacks']:.2f} s | "
                f"{t['first_batch']:.2f} s | **{t['first_step']:.2f} s** | {t['exit']:.2f} s | {busy} |"
            )
    lines.append("")
    for n, r in summary["results"].items():
        if "arrow_conversion_s" in r:
            lines.append(f"- {int(n):,} rows: one-time json -> Arrow conversion ~{r['arrow_conversion_s']:.2f} s "
                         f"(data setup {r['data_setup_cold_s']:.2f} s cold vs {r['data_setup_warm_s']:.2f} s warm; "
                         f"Arrow cache {r['arrow_cache_mb']:.1f} MB)")
    g = summary["warm_first_step_growth"]
    if g:
        lines.append(f"- warm cache, process start -> end of first step: {g['first_step_small_s']:.2f} s at {g['small_rows']:,} rows, "
                     f"{g['first_step_large_s']:.2f} s at {g['large_rows']:,} rows ({g['difference_s']:+.2f} s, {g['ratio']:.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
