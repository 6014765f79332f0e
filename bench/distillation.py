#!/usr/bin/env python
"""OPD, GRPO and SFT on a teacher's completions, side by side at an equal wall-clock budget.

All three start from the same weak student (the SFT demo stopped at step 40) and learn from the
same teacher (the whole SFT demo, 300 steps), on the reverse-text tasks, on this machine's CPU
with real vLLM servers:

  opd          `examples/reverse_text/opd.yaml`: the student samples, the teacher server returns
               its top 20 tokens per position, reverse KL over them and a tail bin (before
               2026-12-04: the sampled-token estimator, 16 x 4, one step of staleness).
  grpo         `examples/reverse_text/grpo.yaml`: the student samples, the reverse-text reward
               (no teacher at all: what RL alone gets in the same time).
  sft_teacher  `examples/reverse_text/sft_teacher.yaml`: the teacher samples, the student trains
               cross-entropy on its tokens.
  grpo_replay  `examples/reverse_text/grpo_replay.yaml`: GRPO plus the SFT rows replayed in every
               batch (a third of it), each loss normalised by its own tokens (no teacher).
  opd_sampled  `opd.yaml` with the teacher on its own vLLM server and `divergence: sampled_reverse_kl`
               (one sampled token's reverse-KL estimate per position, as a policy gradient).
  opd_reverse_kl, opd_forward_kl, opd_jsd
               `opd.yaml` with the teacher in the trainer's process (`model.teacher_model`) and
               that divergence over the whole vocabulary (`opd_jsd`: beta 0.5).
  opd_topk_reverse_kl, opd_topk_forward_kl, opd_topk_jsd
               `opd.yaml` with the teacher on its own vLLM server returning its top 20 tokens per
               position (`teacher_top_k`), that divergence over them and a tail bin.
  trl_grpo     TRL's `GRPOTrainer` (a child process, `bench/trl_grpo.py`): the GRPO method's settings,
               the same prompts in lit-rl's draw order; `+iterN` (num_iterations), `+t07`, `+lr1e4`
               (and the other lr modifiers below), `+seedN`.
  trl          TRL's `DistillationTrainer` (a child process): on-policy, beta 1.0 (reverse KL over
               the whole vocabulary), teacher in process, `use_vllm=False`, opd.yaml's lr and AdamW
               (no weight decay, constant rate, clipping at 1.0), 64 completions per step (16 x 4
               accumulated), at most 48 new tokens, temperature 1, float32, no gradient checkpointing.

A lit-rl method may carry modifiers after a `+` (`opd_topk_reverse_kl+group1+fresh`): `group1`
samples one completion per task (64 tasks a step instead of 16 x 4, as TRL's batch is), `fresh`
sets `max_staleness` 0 (every sample from the current weights, as TRL's are); since 2026-12-04
opd.yaml has both, and `group4` / `stale1` give its earlier batch (16 x 4, one step of staleness)
that the tables before that date ran with. For `opd_sampled`: `rawadv` trains the raw advantage
(no baseline, as before 2026-12-04), `clip1` clips each token's advantage to [-1, 1] (the
default since 2026-12-04), `noclip` does not, `warmup10`
warms the lr up linearly over 10 steps (transformers' constant_with_warmup). For `grpo`: `upb2`
sets `updates_per_batch` 2 (TRL's `num_iterations`), `t07` samples at temperature 0.7,
`scalebatch` / `scalenone` divide the advantage by the batch's reward std / by nothing (the
default divides by the group's), `lr1e4`, `lr3e4`, `lr5e4`, `lr1e3`, `lr2e3`, `lr3e3` train at
lr 1e-4, 3e-4 (grpo.yaml's until 2026-12-05: the GRPO tables in docs/benchmarks.md before then),
5e-4, 1e-3, 2e-3, 3e-3 (AdamW, no weight decay), `lora` trains a LoRA adapter (rank 16, alpha 32, all linear layers) instead of every weight,
after it `r4` / `r64` set the rank (alpha twice the rank: the same alpha / rank scale) and
`alpha64` / `alpha128` the alpha (scale 4 / 8 at rank 16),
`cos` decays the lr by a cosine to 0.1x over the run, `wcos` warms it up over 4 steps first. Any lit-rl
method may carry `nobatch`: one request to the server per rollout (`--inference.batch_prompts false`,
as lit-rl sent them before 2026-12-06) instead of one for the rollouts that start together. A method whose
teacher is a server (`opd`, `opd_sampled`, `opd_topk_*`) may carry `keeptok`: that server keeps its tokenizer
(`--no-skip-tokenizer-init`, as lit-rl started it before 2026-12-07). `omp2` gives the policy's server
two OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND=0-1`; lit-rl's default on a CPU: the cores but one). Any method, `trl`
too, may carry `seedN` (`trl+seed1`): the run's seed (default: opd.yaml's `seed_everything`), to
see how far two runs of one setting differ. For lit-rl it is `seed_everything`, which since
2026-12-06 also sets the task order and the policy server's sampler seed (lit_rl/run_seed.py);
before, every lit-rl seed drew seed 0's tasks from a server seeded 0.

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
    .venv/bin/python bench/distillation.py --methods opd_sampled,opd_reverse_kl,trl --steps 40 --every 10
    .venv/bin/python bench/distillation.py --methods grpo,trl_grpo,grpo+upb2,trl_grpo+iter2 --steps 40 --every 10

Besides the held-out curve, each run reports its seconds per optimizer step after the first
(lit-rl: from `train/tokens / train/tokens_per_s` of each logged step, which spans the step's wait
for data, compute and weight sync; TRL: between its step-end callbacks) and its peak resident set
(lit-rl: `train/peak_memory_gb`, the trainer process alone; TRL: its process).
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
import trl_grpo  # noqa: E402
from _common import REPO, STUDENT, TEACHER, require_checkpoint  # noqa: E402
from trl_child import export_and_clock, read_spec, recording, run_child, write_speed  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "examples", "reverse_text"))
from exact_match import score  # noqa: E402

from lit_rl.commands import report  # noqa: E402
from lit_rl.eval.logging import EvalLogger  # noqa: E402

OPD = "examples/reverse_text/opd.yaml"
with open(os.path.join(REPO, OPD)) as _f:
    _INFERENCE = yaml.safe_load(_f)["inference"]
TEACHER_SERVER, SERVER = _INFERENCE["teacher_server"], _INFERENCE["server"]  # opd.yaml's server options
CONFIGS = {
    "opd": (OPD, "OPD as in opd.yaml"),
    "grpo": ("examples/reverse_text/grpo.yaml", "GRPO (reward only)"),
    "sft_teacher": ("examples/reverse_text/sft_teacher.yaml", "SFT on the teacher's completions"),
    "grpo_replay": ("examples/reverse_text/grpo_replay.yaml", "GRPO + replay of the SFT rows"),
    "opd_sampled": (OPD, "OPD, sampled-token reverse KL, teacher server"),
    "opd_reverse_kl": (OPD, "OPD, reverse KL over the vocabulary, teacher in process"),
    "opd_forward_kl": (OPD, "OPD, forward KL over the vocabulary, teacher in process"),
    "opd_jsd": (OPD, "OPD, JSD beta 0.5 over the vocabulary, teacher in process"),
    "opd_topk_reverse_kl": (OPD, "OPD, reverse KL over the teacher server's top 20 + tail"),
    "opd_topk_forward_kl": (OPD, "OPD, forward KL over the teacher server's top 20 + tail"),
    "opd_topk_jsd": (OPD, "OPD, JSD beta 0.5 over the teacher server's top 20 + tail"),
    "trl": (None, "TRL DistillationTrainer (beta 1, teacher in process)"),
    "trl_grpo": (None, "TRL GRPOTrainer (reward only)"),
}
NO_TEACHER = ("grpo", "grpo_replay")
TRL = ("trl", "trl_grpo")
IN_PROCESS = {"opd_reverse_kl": "reverse_kl", "opd_forward_kl": "forward_kl", "opd_jsd": "jsd"}
SERVED_TOPK = {f"opd_topk_{d}": d for d in ("reverse_kl", "forward_kl", "jsd")}
MODIFIERS = {"group1": ["--data.init_args.group_size", "1"], "fresh": ["--data.init_args.max_staleness", "0"],
             "group4": ["--data.init_args.group_size", "4"], "stale1": ["--data.init_args.max_staleness", "1"],
             "rawadv": ["--model.init_args.advantage_baseline", "none"],
             "upb2": ["--model.init_args.updates_per_batch", "2"], "t07": ["--data.init_args.temperature", "0.7"],
             "scalebatch": ["--data.init_args.scale", "batch"], "scalenone": ["--data.init_args.scale", "none"],
             **{f"lr{name}": ["--model.init_args.optimizer", json.dumps({"class_path": "torch.optim.AdamW", "init_args": {
                 "lr": lr, "weight_decay": 0.0}})] for name, lr in trl_grpo.LRS.items()},
             "lora": ["--model.init_args.lora.rank", "16", "--model.init_args.lora.alpha", "32"],
             **{f"r{r}": ["--model.init_args.lora.rank", str(r), "--model.init_args.lora.alpha", str(2 * r)] for r in (4, 64)},
             **{f"alpha{a}": ["--model.init_args.lora.alpha", str(a)] for a in (64, 128)},
             "nobatch": ["--inference.batch_prompts", "false"],
             "omp2": ["--inference.server", json.dumps({**SERVER, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}})],
             "keeptok": ["--inference.teacher_server", json.dumps({**TEACHER_SERVER, "extra_args": ["--no-skip-tokenizer-init"]})],
             "clip1": ["--model.init_args.advantage_clip", "1.0"], "noclip": ["--model.init_args.advantage_clip", "null"],
             "warmup10": ["--model.init_args.lr_scheduler", json.dumps({"class_path": "lit_rl.optim.LRSchedule", "init_args": {
                 "name": "constant_with_warmup", "warmup_steps": 10}})],
             "cos": ["--model.init_args.lr_scheduler", json.dumps({"class_path": "lit_rl.optim.LRSchedule", "init_args": {
                 "name": "cosine_with_min_lr", "warmup_steps": 0, "scheduler_kwargs": {"min_lr_rate": 0.1}}})],
             "wcos": ["--model.init_args.lr_scheduler", json.dumps({"class_path": "lit_rl.optim.LRSchedule", "init_args": {
                 "name": "cosine_with_min_lr", "warmup_steps": 4, "scheduler_kwargs": {"min_lr_rate": 0.1}}})]}


def base_method(method: str) -> str:
    return method.split("+")[0]


def method_seed(method: str) -> int | None:
    """N of a `+seedN` modifier, None without one."""
    return next((int(m[4:]) for m in method.split("+")[1:] if m[:4] == "seed" and m[4:].isdigit()), None)


def modifier_flags(method: str) -> list[str]:
    seed = method_seed(method)
    flags = [] if seed is None else ["--seed_everything", str(seed)]
    return flags + [flag for m in method.split("+")[1:] if m in MODIFIERS for flag in MODIFIERS[m]]
HELD_OUT = os.path.join(REPO, "examples", "reverse_text", "data", "test.jsonl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="opd,grpo,sft_teacher", help=f"comma separated, of {list(CONFIGS)}")
    p.add_argument("--student", default=STUDENT)
    p.add_argument("--teacher", default=TEACHER)
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
    def known(method: str) -> bool:
        if base_method(method) == "trl_grpo":
            try:
                trl_grpo.modifiers(method)
                return True
            except ValueError:
                return False
        mods = [m for m in method.split("+")[1:] if not (m[:4] == "seed" and m[4:].isdigit())]
        return base_method(method) in CONFIGS and all(m in MODIFIERS for m in mods) and not (
            mods and base_method(method) == "trl")

    unknown = sorted(m for m in args.methods if not known(m))
    if unknown:
        p.error(f"unknown methods {unknown}; known: {list(CONFIGS)}, lit-rl's with +{'/+'.join(MODIFIERS)}, "
                "trl_grpo with +iterN/+t07/+lrNAME, any with +seedN")
    for what in ("student", "teacher"):
        require_checkpoint(p, f"--{what}", getattr(args, what), makes="both")
    return args


def method_config(args, method: str, root: str) -> str:
    """The example's config with an HF export every `--every` steps, all kept (written beside the run)."""
    config, _ = CONFIGS[base_method(method)]
    with open(os.path.join(REPO, config)) as f:
        data = yaml.safe_load(f)
    callbacks = [c for c in data["trainer"]["callbacks"] if not c["class_path"].endswith("HFExport")]
    callbacks.append({"class_path": "lit_rl.callbacks.HFExport", "init_args": {"every_n_steps": args.every}})
    data["trainer"]["callbacks"] = callbacks
    path = root + ".yaml"
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def teacher_flags(args, method: str) -> list[str]:
    """Where the method's teacher runs: in the trainer (model.teacher_model) or on a vLLM server."""
    in_process = ["--inference.teacher_model", "null", "--inference.teacher_server", "{}", "--model.init_args.teacher_model",
                  args.teacher]
    if method in IN_PROCESS:
        return in_process + ["--model.init_args.divergence", IN_PROCESS[method]]
    if method == "opd_sampled" or method in SERVED_TOPK:
        return ["--inference.teacher_model", args.teacher, "--model.init_args.teacher_model", "null",
                "--model.init_args.divergence", SERVED_TOPK.get(method, "sampled_reverse_kl"),
                "--model.init_args.teacher_top_k", "20"]
    if method == "opd":  # as the example has it
        with open(os.path.join(REPO, OPD)) as f:
            example = yaml.safe_load(f)
        if example["model"]["init_args"].get("teacher_model"):
            return ["--model.init_args.teacher_model", args.teacher]
    return [] if method in NO_TEACHER else ["--inference.teacher_model", args.teacher]


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
    cmd += teacher_flags(args, base_method(method))
    cmd += modifier_flags(method)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with open(root + ".log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed (exit {proc.returncode}); see {root}.log")
    return time.perf_counter() - started


def lit_rl_speed(root: str) -> dict:
    """Seconds per optimizer step after the first, and the trainer's peak resident set, from metrics.csv."""
    import csv
    import glob

    (path,) = sorted(glob.glob(os.path.join(root, "logs", "version_*", "metrics.csv")))[-1:]
    rows = [r for r in csv.DictReader(open(path)) if r.get("train/tokens_per_s")]
    spans = [float(r["train/tokens"]) / float(r["train/tokens_per_s"]) for r in rows[1:]]
    means = {k: sum(float(r[f"train/{k}"]) for r in rows) / len(rows) for k in ("clip_fraction", "mismatch_kl")
             if all(r.get(f"train/{k}") for r in rows)}  # GRPO's
    return {"step_s": sum(spans) / max(len(spans), 1), "peak_rss_gb": max(float(r["train/peak_memory_gb"]) for r in rows),
            **means}


def run_method(args, method: str, student: dict) -> dict:
    root = os.path.abspath(os.path.join(args.out, method))
    speed = {}
    if args.score_only:
        wall = None
    elif base_method(method) == "trl":
        wall, speed = train_trl(args, root, method_seed(method))
    elif base_method(method) == "trl_grpo":
        wall, speed = trl_grpo.train_trl_grpo(args, method, root)
    else:
        wall = train_method(args, method, root)
        speed = lit_rl_speed(root)
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
    label = CONFIGS[base_method(method)][1] + "".join(f" +{m}" for m in method.split("+")[1:])
    return {"label": label, "wall_s": wall, "curve": curve, **speed}


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
             f"| lowest by step 20, greedy / sampled | first step at {args.fraction:.0%} of the teacher, greedy | same, sampled "
             "| s per step | peak RSS | run wall time |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for m, r in results.items():
        last = r["curve"][-1]
        reach = [first_step_reaching(r["curve"], k, args.fraction * teacher[k]) for k in ("reward", "sampled_reward")]
        r["reach"] = dict(zip(("greedy", "sampled"), reach))
        early = [p for p in r["curve"] if p["step"] <= 20] or r["curve"][:1]
        r["lowest_by_20"] = {k: min(p[k] for p in early) for k in ("reward", "sampled_reward")}
        lines.append(f"| {r['label']} | {last['step']} | {student['reward']:.3f} -> {last['reward']:.3f} | "
                     f"{student['sampled_reward']:.3f} -> {last['sampled_reward']:.3f} | "
                     f"{r['lowest_by_20']['reward']:.3f} / {r['lowest_by_20']['sampled_reward']:.3f} | "
                     f"{reach[0] if reach[0] is not None else 'not reached'} | "
                     f"{reach[1] if reach[1] is not None else 'not reached'} | "
                     f"{format(r['step_s'], '.2f') + ' s' if 'step_s' in r else '-'} | "
                     f"{format(r['peak_rss_gb'], '.2f') + ' GB' if 'peak_rss_gb' in r else '-'} | "
                     f"{'-' if r['wall_s'] is None else format(r['wall_s'], '.0f') + ' s'} |")
    print("\n".join(lines))
    for m, r in results.items():  # the policy-gradient runs' trust region and sampler mismatch, mean over steps
        if r.get("clip_fraction") is not None:
            print(f"{m}: clip_fraction {r['clip_fraction']:.4f}"
                  + (f", mismatch_kl {r['mismatch_kl']:.2e}" if "mismatch_kl" in r else ""))
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


# ---- TRL (runs in a child process: `--trl-worker spec.json`) -----------------------------------------
def train_trl(args, root: str, seed: int | None = None, record: str | None = None,
              beta: float = 1.0) -> tuple[float, dict]:
    """TRL's DistillationTrainer from the same student, teacher, prompts and optimizer settings, with
    an export into `root/weights/step_N` every `--every` steps (scored like lit-rl's). With
    `record`, the child also writes every generation batch it trained on to that JSON file
    (`bench/opd_same_samples.py` trains lit-rl on them); `beta` is TRL's (1: reverse KL)."""
    if not args.steps:
        raise SystemExit("the trl method needs --steps (TRL has no wall-clock budget)")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    with open(os.path.join(REPO, OPD)) as f:
        example = yaml.safe_load(f)
    optimizer = example["model"]["init_args"]["optimizer"]
    if optimizer["class_path"] != "torch.optim.AdamW" or optimizer["init_args"].get("weight_decay", 0.01) != 0.0:
        raise RuntimeError(f"{OPD}: the bench gives TRL AdamW without weight decay; update it")
    data = example["data"]["init_args"]
    spec = {"student": args.student, "teacher": args.teacher, "root": root, "steps": args.steps, "every": args.every,
            "lr": optimizer["init_args"]["lr"], "batch": data["batch_size"], "max_tokens": data["max_tokens"],
            "prompts": os.path.join(REPO, data["env"]["init_args"]["path"]), "seed": example.get("seed_everything", 0) if seed is None else seed,
            "out": os.path.join(root, "trl_result.json"), "record": record, "beta": beta}
    return run_child([os.path.abspath(__file__), "--trl-worker"], spec, root, "trl")


def trl_worker(spec_path: str) -> None:
    spec = read_spec(spec_path)
    import datasets
    from transformers import AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    with open(spec["prompts"]) as f:
        rows = [{"prompt": json.loads(line)["messages"][:1]} for line in f]
    tokenizer = AutoTokenizer.from_pretrained(spec["student"])
    ticks: list[float] = []

    micro = 16
    config = DistillationConfig(
        output_dir=os.path.join(spec["root"], "trl_out"), use_cpu=True, use_vllm=False, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=micro, gradient_accumulation_steps=spec["batch"] // micro,
        max_completion_length=spec["max_tokens"], temperature=1.0, top_p=1.0, top_k=0, beta=spec.get("beta", 1.0),
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
        max_grad_norm=1.0, max_steps=spec["steps"], logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=spec["seed"],
        model_init_kwargs={"dtype": "float32"}, teacher_model_init_kwargs={"dtype": "float32"},
    )
    trainer = DistillationTrainer(model=spec["student"], teacher_model=spec["teacher"], args=config,
                                  train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                                  callbacks=[export_and_clock(spec, tokenizer, ticks)])
    with recording(trainer, spec.get("record"), ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")):
        trainer.train()
    write_speed(spec, ticks)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2])
    else:
        main()
