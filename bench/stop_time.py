"""Seconds from SIGTERM to the exit of a GRPO run whose vLLM server is busy (target: under 30 s).

    .venv/bin/python bench/stop_time.py [--rounds 3] [--after-steps 3] [--max-tokens 256]

Runs `examples/reverse_text/grpo.yaml` on the built-in tiny model from random init (64 samples
a step, up to 128 rollouts in flight, `--max-tokens` each: a random model rarely stops early, so
the server is never idle), waits until `--after-steps` steps are trained, then sends SIGTERM,
alternating two ways each round: to the trainer's process group only, and to the whole job (the
trainer's group and the server's, as a cluster scheduler does). It reports the time until the
trainer exits, its exit code, the step of the checkpoint it saved, and any process of the run
left behind. A cluster scheduler's grace period is often 30-60 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def processes_of(path: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def one_run(workdir: Path, data: str, after_steps: int, max_tokens: int, whole_job: bool) -> dict:
    root = workdir / ("whole_job" if whole_job else "trainer")
    cmd = [sys.executable, "-m", "lit_rl.cli", "fit", "--config", str(REPO / "examples/reverse_text/grpo.yaml"),
           "--model.init_args.model", "lit-rl:tiny_qwen3", "--model.init_args.random_init", "true",
           "--data.init_args.env.init_args.path", data, "--data.init_args.max_tokens", str(max_tokens),
           "--inference.server.max_model_len", str(max_tokens + 128),
           "--trainer.max_steps", "1000", "--trainer.default_root_dir", str(root)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    trace = root / "rollouts" / "trained.jsonl"
    while not (trace.exists() and len(trace.read_text().splitlines()) >= after_steps):
        if proc.poll() is not None:
            raise SystemExit(f"the run ended early:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    groups = {proc.pid}
    if whole_job:
        groups |= {os.getpgid(pid) for pid in processes_of(root) if pid != proc.pid}
    sent = time.monotonic()
    for pgid in groups:
        os.killpg(pgid, signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    took = time.monotonic() - sent
    time.sleep(1.0)
    left = processes_of(root)
    ckpt = root / "checkpoints" / "last.ckpt"
    step = torch.load(ckpt, weights_only=False, map_location="cpu")["global_step"] if ckpt.exists() else None
    return {"way": "whole job" if whole_job else "trainer", "seconds": took, "code": proc.returncode,
            "saved_step": step, "left": left, "last_line": err.strip().splitlines()[-1][:160]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--after-steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="lit-rl-stop-") as tmp:
        subprocess.run([sys.executable, str(REPO / "examples/reverse_text/make_data.py"), "--out", f"{tmp}/data",
                        "--train", "2000", "--test", "10"], check=True, capture_output=True)
        data = f"{tmp}/data/train.jsonl"
        for r in range(args.rounds):
            for whole_job in (False, True):
                run_dir = Path(tmp) / f"round{r}"
                result = one_run(run_dir, data, args.after_steps, args.max_tokens, whole_job)
                results.append(result)
                print(f"round {r} {result['way']:>9}: {result['seconds']:.1f} s to exit, code {result['code']}, "
                      f"checkpoint at step {result['saved_step']}, left {result['left']}\n    {result['last_line']}",
                      flush=True)
    for way in ("trainer", "whole job"):
        times = [r["seconds"] for r in results if r["way"] == way]
        print(f"SIGTERM to the {way}: median {statistics.median(times):.1f} s, max {max(times):.1f} s "
              f"over {len(times)} runs")


if __name__ == "__main__":
    main()
