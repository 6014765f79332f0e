#!/usr/bin/env python
"""OPD, GRPO and SFT on a teacher's completions, side by side at an equal wall-clock budget.

All three start from the same weak student (the SFT demo stopped at step 40) and learn from the
same teacher (the whole SFT demo, 300 steps), on the reverse-text tasks, on this machine's CPU
with real vLLM servers:

  opd          `examples/reverse_text/opd.yaml`: the student samples, the teacher scores every
               token, per-token reverse KL.
  grpo         `examples/reverse_text/grpo.yaml`: the student samples, the reverse-text reward
               (no teacher at all: what RL alone gets in the same time).
  sft_teacher  `examples/reverse_text/sft_teacher.yaml`: the teacher samples, the student trains
               cross-entropy on its tokens.
  grpo_replay  `examples/reverse_text/grpo_replay.yaml`: GRPO plus the SFT rows replayed in every
               batch (a third of it), each loss normalised by its own tokens (no teacher).

Each runs `lit-rl fit` for `--minutes` of training (Lightning's `max_time`; the run's wall time,
servers' start-up included, is reported beside it) with an HF export every `--every` steps. Afterwards every export
is scored on the held-out set with `examples/reverse_text/exact_match.py` (greedy reward, and the
mean reward of 4 samples at temperature 1), and the script prints, per method, the curve and the
first step whose held-out reward reaches `--fraction` of the teacher's. The scores are also written
into each run's `evals/eval_metrics.csv`, and the curves of all runs overlaid into
`<out>/report.png` (`lit-rl report` over the run directories).

    .venv/bin/python bench/distillation.py                  # 3 x 4 min of training + scoring
    .venv/bin/python bench/distillation.py --methods opd,grpo --minutes 6 --json out.json
    .venv/bin/python bench/distillation.py --methods grpo,grpo_replay --steps 60 --out runs/replay_bench
    .venv/bin/python bench/distillation.py --score-only     # re-score the runs already there, overlay them
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import yaml

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from _common import REPO  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "examples", "reverse_text"))
from exact_match import score  # noqa: E402

from lit_rl.commands import report  # noqa: E402
from lit_rl.eval.logging import EvalLogger  # noqa: E402

CONFIGS = {
    "opd": ("examples/reverse_text/opd.yaml", "OPD (teacher scores the student's tokens)"),
    "grpo": ("examples/reverse_text/grpo.yaml", "GRPO (reward only)"),
    "sft_teacher": ("examples/reverse_text/sft_teacher.yaml", "SFT on the teacher's completions"),
    "grpo_replay": ("examples/reverse_text/grpo_replay.yaml", "GRPO + replay of the SFT rows"),
}
NO_TEACHER = ("grpo", "grpo_replay")
HELD_OUT = os.path.join(REPO, "examples", "reverse_text", "data", "test.jsonl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="opd,grpo,sft_teacher", help=f"comma separated, of {list(CONFIGS)}")
    p.add_argument("--student", default="runs/reverse_text_sft_short/weights/step_40")
    p.add_argument("--teacher", default="runs/reverse_text_sft/weights/step_300")
    p.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of each run (Lightning max_time)")
    p.add_argument("--steps", type=int, default=None, help="a budget of optimizer steps instead of --minutes")
    p.add_argument("--score-only", action="store_true",
                   help="train nothing: score the exports of runs already under --out (and overlay them)")
    p.add_argument("--every", type=int, default=10, help="export (and later score) every N optimizer steps")
    p.add_argument("--samples", type=int, default=4, help="completions per held-out prompt for the sampled reward")
    p.add_argument("--fraction", type=float, default=0.9, help="report the first step reaching this share of the teacher's reward")
    p.add_argument("--out", default="runs/distillation_bench", help="where the runs go")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(CONFIGS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {list(CONFIGS)}")
    for what in ("student", "teacher"):
        if not os.path.isfile(os.path.join(getattr(args, what), "STABLE")):
            p.error(f"--{what} {getattr(args, what)} is not a finished checkpoint; bash examples/reverse_text/run_opd_demo.sh makes both")
    return args


def method_config(args, method: str, root: str) -> str:
    """The example's config with an HF export every `--every` steps, all kept (written beside the run)."""
    config, _ = CONFIGS[method]
    with open(os.path.join(REPO, config)) as f:
        data = yaml.safe_load(f)
    callbacks = [c for c in data["trainer"]["callbacks"] if not c["class_path"].endswith("HFExport")]
    callbacks.append({"class_path": "lit_rl.callbacks.HFExport", "init_args": {"every_n_steps": args.every}})
    data["trainer"]["callbacks"] = callbacks
    path = root + ".yaml"
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def train_method(args, method: str, root: str) -> float:
    """`lit-rl fit` of the method's example config into a fresh `root`; its wall time in seconds."""
    shutil.rmtree(root, ignore_errors=True)  # a fresh run: no steps, logs or scores of an earlier one
    os.makedirs(args.out, exist_ok=True)
    cmd = [os.path.join(REPO, ".venv", "bin", "lit-rl"), "fit", "--config", method_config(args, method, root),
           "--model.init_args.model", args.student, "--trainer.default_root_dir", root,
           "--trainer.enable_progress_bar", "false"]
    if args.steps:  # a step budget: what each method learns per step, whatever else the machine runs
        cmd += ["--trainer.max_steps", str(args.steps)]
    else:
        minutes = int(args.minutes)
        seconds = int(round((args.minutes - minutes) * 60))
        cmd += ["--trainer.max_time", f"00:00:{minutes:02d}:{seconds:02d}", "--trainer.max_steps", "100000"]
    if method not in NO_TEACHER:
        cmd += ["--inference.teacher_model", args.teacher]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with open(root + ".log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed (exit {proc.returncode}); see {root}.log")
    return time.perf_counter() - started


def run_method(args, method: str, student: dict) -> dict:
    root = os.path.abspath(os.path.join(args.out, method))
    wall = None if args.score_only else train_method(args, method, root)
    if not os.path.isdir(os.path.join(root, "weights")):
        raise RuntimeError(f"{method}: no exports under {root}/weights to score")
    steps = sorted(int(d.split("_")[1]) for d in os.listdir(os.path.join(root, "weights")) if d.startswith("step_"))
    curve = []
    scores = os.path.join(root, "evals", "eval_metrics.csv")
    if os.path.exists(scores):
        os.remove(scores)  # scored afresh
    evals = EvalLogger(os.path.dirname(scores))  # so that `lit-rl report` can overlay the runs
    evals.log(0, {"eval/held_out/greedy_reward": student["reward"], "eval/held_out/sampled_reward": student["sampled_reward"]})
    for step in steps:
        s = score(os.path.join(root, "weights", f"step_{step}"), HELD_OUT, samples=args.samples)
        curve.append({"step": step, **s})
        evals.log(step, {"eval/held_out/greedy_reward": s["reward"], "eval/held_out/sampled_reward": s["sampled_reward"]})
        print(f"{method} step {step}: greedy {s['reward']:.3f}, sampled {s['sampled_reward']:.3f}", flush=True)
    return {"label": CONFIGS[method][1], "wall_s": wall, "curve": curve}


def first_step_reaching(curve: list[dict], key: str, bar: float) -> int | None:
    return next((p["step"] for p in curve if p[key] >= bar), None)


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    teacher = score(args.teacher, HELD_OUT, samples=args.samples)
    student = score(args.student, HELD_OUT, samples=args.samples)
    print(f"teacher: greedy {teacher['reward']:.3f}, sampled {teacher['sampled_reward']:.3f}; "
          f"student: greedy {student['reward']:.3f}, sampled {student['sampled_reward']:.3f}", flush=True)
    results = {m: run_method(args, m, student) for m in args.methods}
    lines = ["| method | steps in the budget | held-out reward, greedy (start -> end) | held-out reward, sampled (start -> end) "
             f"| first step at {args.fraction:.0%} of the teacher, greedy | same, sampled | run wall time |",
             "|---|---:|---|---|---:|---:|---:|"]
    for m, r in results.items():
        last = r["curve"][-1]
        reach = [first_step_reaching(r["curve"], k, args.fraction * teacher[k]) for k in ("reward", "sampled_reward")]
        r["reach"] = dict(zip(("greedy", "sampled"), reach))
        lines.append(f"| {r['label']} | {last['step']} | {student['reward']:.3f} -> {last['reward']:.3f} | "
                     f"{student['sampled_reward']:.3f} -> {last['sampled_reward']:.3f} | "
                     f"{reach[0] if reach[0] is not None else 'not reached'} | "
                     f"{reach[1] if reach[1] is not None else 'not reached'} | "
                     f"{'-' if r['wall_s'] is None else format(r['wall_s'], '.0f') + ' s'} |")
    print("\n".join(lines))
    budget = "as trained earlier (--score-only)" if args.score_only else (
        f"{args.steps} steps per run" if args.steps else f"{args.minutes} min per run")
    print(f"teacher: greedy {teacher['reward']:.3f}, sampled {teacher['sampled_reward']:.3f}; budget {budget}; "
          f"total {time.perf_counter() - start:.0f} s")
    runs = [os.path.abspath(os.path.join(args.out, m)) for m in results]
    report.main([*runs, "--out", os.path.join(args.out, "report.png"), "--metrics", "train/loss", "train/reward",
                 "eval/held_out/greedy_reward", "eval/held_out/sampled_reward"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"teacher": teacher, "student": student, "settings": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
