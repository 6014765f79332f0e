#!/usr/bin/env python
"""Seconds per GRPO optimizer step: lit-rl (the real CLI, its own vLLM CPU server) against TRL's GRPOTrainer.

Both contenders train the same random init of the built-in tiny Qwen3 (3.2M parameters,
byte-level tokenizer; saved once to a temp dir), on the reverse-text tasks of
`examples/reverse_text/make_data.py`, with the reverse-text reward (`lcs_ratio` of the stripped
completion against the reversed text, as `ReverseTextEnv.reward`), `--tasks` prompts x
`--group-size` completions per optimizer step, at most `--max-tokens` completion tokens,
temperature 1, one optimizer step per batch of rollouts, AdamW with the lr of
`examples/reverse_text/grpo.yaml`, weight decay 0, gradient clipping at 1.0, DAPO's token-mean
loss with clipping 0.2 / 0.28, no KL term.

Contenders (each run a fresh process; contenders alternate, the order reversed every other round):
  lit-rl s=0, s=1   `lit-rl fit --config examples/reverse_text/grpo.yaml` with overrides (model,
                    data, sizes, `--data.init_args.max_staleness 0` or `1`, no checkpoints, no
                    progress bar). lit-rl starts its own vLLM CPU server (tens of seconds; not timed),
                    rollouts come from it, and after every step its InferenceRuntime exports the weights and
                    reloads the server. Per-step times come from the run's metrics CSV
                    (<root>/logs/version_0/metrics.csv): `train/tokens / train/tokens_per_s` is the
                    time from the end of the previous optimizer step to the end of this one (the
                    previous step's weight sync, the wait for this step's rollouts, forward, backward
                    and optimizer); `train/data_wait_s`, `train/compute_s`, `train/weight_sync_s`
                    split it.
  TRL               `trl.GRPOTrainer` on CPU (`use_cpu=True`, `use_vllm=False`: completions from
                    `model.generate` of transformers, with the trained weights, so no weight sync),
                    a `datasets.Dataset` of the same prompts (conversational `prompt` column, in the
                    order lit-rl's buffer draws them, `shuffle_dataset=False`),
                    `num_generations=--group-size`, `max_completion_length=--max-tokens`,
                    `per_device_train_batch_size=--trl-mb` x `gradient_accumulation_steps` =
                    tasks x group size: one generation batch per optimizer step
                    (`steps_per_generation` = `gradient_accumulation_steps`, `num_iterations=1`, so
                    TRL computes no old log-probabilities either). `bf16=False` and
                    `gradient_checkpointing=False` (GRPOConfig turns both on; lit-rl runs float32
                    without checkpointing, and both slow a CPU down). A TrainerCallback takes a
                    timestamp at every `on_step_end`; the time in `_generate_single_turn` is also
                    recorded (TRL's share of the step spent generating).

Diagnostics (not in the default set): `lit0_spin1s`, `lit1_spin1s` are the lit-rl runs with vLLM's
own worker spin-wait after each batch (1 s; lit-rl's servers spin 10 ms on CPU, see
lit_rl/inference/vllm_main.py), set through LIT_RL_VLLM_SPIN_S=1: what that spin costs.
`lit0_nobatch`, `lit1_nobatch` send one request per rollout (`--inference.batch_prompts false`, as
lit-rl did before 2026-12-06) instead of one for the rollouts that start together.

Steady state: each run does `--warmup` + `--steps` + 1 optimizer steps; s/step is the time from the
end of the last warm-up step to the end of the last timed step over `--steps` (set-up, lit-rl's
server start-up and the first steps are excluded). The extra last step is not timed on either side:
lit-rl's rollouts stop at `max_steps`, so with max_staleness=1 its last step trains with no
generation of a next batch beside it, which would flatter the mean. The prompts the two sides use
are checked to tokenize to the same ids.

The machine may be shared: before each run the script waits (`--quiet-wait`) for a quiet CPU and
records how many cores other processes kept busy during the run (last column).

    .venv/bin/python bench/grpo_step.py                       # defaults: ~6 min on 2 quiet cores
    .venv/bin/python bench/grpo_step.py --rounds 3 --json out.json
    .venv/bin/python bench/grpo_step.py --contenders lit0,lit0_spin1s,lit1,lit1_spin1s,trl
    .venv/bin/python bench/grpo_step.py --contenders trl --rounds 1 --trl-mb 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from _common import REPO, TINY_MODEL, exit_on_sigterm, machine_busy_s, report, tree_pids, wait_until_quiet  # noqa: E402

_HZ = os.sysconf("SC_CLK_TCK")

CONFIG = os.path.join(REPO, "examples", "reverse_text", "grpo.yaml")
MAKE_DATA = os.path.join(REPO, "examples", "reverse_text", "make_data.py")
CONTENDERS = {
    "lit0": "lit-rl max_staleness=0",
    "lit1": "lit-rl max_staleness=1",
    "trl": "TRL GRPOTrainer",
    # diagnostics, not in the default set: vLLM's worker spin-waits (os.sched_yield in a loop) for
    # 1 s after every message from its engine core (shm_broadcast.SpinCondition), i.e. for a second
    # after each batch of rollouts, on a core the trainer needs. lit-rl's servers cut that to 10 ms
    # on CPU (lit_rl/inference/vllm_main.py); these runs put vLLM's 1 s back.
    "lit0_spin1s": "lit-rl max_staleness=0, vLLM's 1 s spin",
    "lit1_spin1s": "lit-rl max_staleness=1, vLLM's 1 s spin",
    # one request to the server per rollout, as lit-rl sent them before 2026-12-06, instead of one
    # for the rollouts that start together (lit_rl/inference/batching.py)
    "lit0_nobatch": "lit-rl max_staleness=0, a request per rollout",
    "lit1_nobatch": "lit-rl max_staleness=1, a request per rollout",
}
TARGETS = {"lit0": 2.0, "lit1": 3.0}  # lit-rl at least this many times faster than TRL


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contenders", default="lit0,lit1,trl", help=f"comma separated, of {list(CONTENDERS)}")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; medians are reported")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps per run not timed (>= 1)")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    p.add_argument("--tasks", type=int, default=8, help="prompts per optimizer step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (TRL num_generations)")
    p.add_argument("--max-tokens", type=int, default=48, help="completion length limit (TRL max_completion_length)")
    p.add_argument("--trl-mb", type=int, default=None,
                   help="TRL per_device_train_batch_size (completions per forward; the rest of the step goes to "
                        "gradient accumulation). Default: half the step, as lit-rl's micro_batch_tokens 4096 cuts it")
    p.add_argument("--seed", type=int, default=0, help="seed of the random init (and of TRL's trainer)")
    p.add_argument("--quiet-wait", type=float, default=30.0,
                   help="before each run, wait up to this many seconds for other processes to leave the CPU")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take before it is killed")
    p.add_argument("--json", default=None, help="also write the JSON summary to this file")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data, model, run directories, logs)")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: one TRL run, spec in this file
    args = p.parse_args(argv)
    if args.trl_worker:
        return args
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the end of the last warm-up step starts the clock)")
    if args.steps < 1 or args.rounds < 1 or args.tasks < 1 or args.group_size < 2 or args.max_tokens < 1:
        p.error("--steps, --rounds, --tasks and --max-tokens must be >= 1, --group-size >= 2")
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown or not args.contenders:
        p.error(f"unknown contenders {unknown}; use some of {list(CONTENDERS)}")
    args.batch_size = args.tasks * args.group_size
    if args.trl_mb is None:
        args.trl_mb = args.batch_size // 2 if args.batch_size % 2 == 0 else args.batch_size
    if args.batch_size % args.trl_mb:
        p.error(f"--trl-mb must divide tasks x group size = {args.batch_size}")
    args.total_steps = args.warmup + args.steps  # the end of the timed window
    args.run_steps = args.total_steps + 1  # + an untimed last step (see the module docstring)
    return args


def example_settings() -> dict:
    """The optimizer and loss settings of examples/reverse_text/grpo.yaml, which TRL gets too."""
    import yaml

    with open(CONFIG) as f:
        config = yaml.safe_load(f)
    model = config["model"]["init_args"]
    optimizer = model["optimizer"]
    if optimizer["class_path"] != "torch.optim.AdamW" or optimizer["init_args"].get("weight_decay", 0.0) != 0.0:
        raise RuntimeError(f"{CONFIG}: the bench gives TRL AdamW without weight decay; update it")
    if model.get("loss_type", "dapo") != "dapo" or model.get("kl_coef", 0.0) != 0.0:
        raise RuntimeError(f"{CONFIG}: the bench gives TRL the dapo loss without KL; update it")
    if config["data"]["init_args"].get("temperature", 1.0) != 1.0:
        raise RuntimeError(f"{CONFIG}: the bench samples at temperature 1 on both sides; update it")
    return {"lr": float(optimizer["init_args"]["lr"]), "clip_low": float(model.get("clip_low", 0.2)),
            "clip_high": float(model.get("clip_high", 0.28)), "max_grad_norm": float(model.get("max_grad_norm", 1.0)),
            "data_seed": int(config["data"]["init_args"].get("seed", 0))}


# ---- set-up (in a subprocess: the parent stays free of torch) ----------------------------------------
PREPARE = r"""
import json, random, shutil, sys
import torch
from transformers import AutoTokenizer
from lit_rl.inference.client import chat_prompt_ids
from lit_rl.modules.model_loading import load_causal_lm
from lit_rl.rollouts.envs import ReverseTextEnv
tiny, out, data, seed, data_seed, n_prompts, prompts_path = sys.argv[1:8]
model = load_causal_lm(tiny, random_init=True, seed=int(seed))
model.save_pretrained(out)
tok = AutoTokenizer.from_pretrained(tiny)
tok.save_pretrained(out)
shutil.copy(f"{tiny}/generation_config.json", out)
# the prompts in the order lit-rl's RolloutBuffer draws tasks (epoch 0 of its seeded shuffle)
tasks = ReverseTextEnv(path=data).tasks()
order = list(range(len(tasks)))
random.Random(f"lit-rl:{data_seed}:0").shuffle(order)
rows = [{"prompt": tasks[i]["prompt"], "text": tasks[i]["text"]} for i in order[: int(n_prompts)]]
tok = AutoTokenizer.from_pretrained(out)
for row in rows:  # TRL renders prompts with apply_chat_template(tokenize=True): the same ids as lit-rl?
    ours = chat_prompt_ids(tok, row["prompt"])
    theirs = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    if list(theirs) != list(ours):
        raise SystemExit(f"prompt {row['prompt']!r}: TRL would send other token ids than lit-rl")
with open(prompts_path, "w") as f:
    json.dump(rows, f)
print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "prompts_checked": len(rows)}))
"""


def prepare(args, workdir: str, settings: dict) -> dict:
    data = os.path.join(workdir, "data")
    subprocess.run([sys.executable, MAKE_DATA, "--out", data], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    model, prompts = os.path.join(workdir, "model"), os.path.join(workdir, "trl_prompts.json")
    n_prompts = args.run_steps * args.tasks
    out = subprocess.run(
        [sys.executable, "-c", PREPARE, TINY_MODEL, model, os.path.join(data, "train.jsonl"), str(args.seed),
         str(settings["data_seed"]), str(n_prompts), prompts],
        check=True, cwd=REPO, env=child_env(workdir), capture_output=True, text=True,
    )
    info = json.loads(out.stdout.strip().splitlines()[-1])
    return {"model": model, "train": os.path.join(data, "train.jsonl"), "prompts": prompts, **info}


def child_env(workdir: str) -> dict:
    env = dict(os.environ)
    env.pop("LIT_RL_VLLM_SPIN_S", None)  # lit-rl's default spin unless a contender sets it
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=os.path.join(workdir, "hf_datasets"), PYTHONUNBUFFERED="1")
    return env


# ---- running a child: CPU accounting and a sure teardown --------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return int(stat[19]) if stat else None


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used so far."""
    stat = _stat(pid)
    return (int(stat[11]) + int(stat[12])) / _HZ if stat else None


def _kill_seen(seen: dict[int, int], sig=signal.SIGKILL) -> list[int]:
    """Send `sig` to every process seen in the run's tree that is still the same process (same start time)."""
    hit = []
    for pid, started in seen.items():
        if _start_time(pid) == started:
            try:
                os.kill(pid, sig)
                hit.append(pid)
            except ProcessLookupError:
                pass
    return hit


def run_child(cmd: list[str], log_path: str, workdir: str, timeout: float, env: dict | None = None) -> dict:
    """Run `cmd` (its own session), output to log_path; returns rc, wall time and the cores other
    processes kept busy meanwhile. Whatever happens, the child and every process it started (the
    vLLM server leads a session of its own) are gone when this returns."""
    seen: dict[int, int] = {}  # pid -> start time: every process of the child's tree, ever
    foreign_s, elapsed = 0.0, 0.0
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or child_env(workdir), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    last_ours: dict[int, float] = {}
    before_busy, before_t = machine_busy_s(), time.perf_counter()
    try:
        while True:
            try:
                rc = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                pass
            pids = tree_pids(proc.pid)
            for pid in pids:
                if pid not in seen and (st := _start_time(pid)) is not None:
                    seen[pid] = st
            busy, now_t = machine_busy_s(), time.perf_counter()
            if busy is not None and before_busy is not None:
                ours = 0.0
                for pid in pids:  # per process, so one that exits does not make the sum go backwards
                    cpu = _cpu_s(pid)
                    if cpu is not None:
                        ours += cpu - last_ours.get(pid, 0.0)
                        last_ours[pid] = cpu
                foreign_s += max(0.0, (busy - before_busy) - ours)
                elapsed += now_t - before_t
                before_busy, before_t = busy, now_t
            if now_t - start > timeout:
                raise TimeoutError(f"{' '.join(cmd[:3])}... ran past {timeout:.0f} s")
    finally:
        if proc.poll() is None:  # failure, timeout, Ctrl-C, SIGTERM: a graceful stop first, then force
            for pid in tree_pids(proc.pid):
                if pid not in seen and (st := _start_time(pid)) is not None:
                    seen[pid] = st
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            _kill_seen(seen)
            proc.wait()
        left = _kill_seen(seen)  # e.g. a server the child failed to stop
        if left:
            print(f"killed {len(left)} process(es) left behind by {cmd[0]}: {left}", file=sys.stderr, flush=True)
    return {"rc": rc, "wall_s": time.perf_counter() - start, "foreign_cores": foreign_s / elapsed if elapsed else None}


def _tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


# ---- lit-rl -------------------------------------------------------------------------------------------
def lit_command(args, prep: dict, root: str, staleness: int) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "lit-rl")
    head = [exe] if os.path.exists(exe) else [sys.executable, "-m", "lit_rl.cli"]
    return head + [
        "fit", "--config", CONFIG,
        "--model.init_args.model", prep["model"],
        "--trainer.default_root_dir", root,
        "--trainer.max_steps", str(args.run_steps),
        "--trainer.enable_checkpointing", "false",  # TRL saves nothing either (save_strategy="no")
        "--trainer.enable_progress_bar", "false",  # TRL: disable_tqdm=True
        "--data.init_args.env.init_args.path", prep["train"],
        "--data.init_args.batch_size", str(args.batch_size),
        "--data.init_args.group_size", str(args.group_size),
        "--data.init_args.max_tokens", str(args.max_tokens),
        "--data.init_args.max_staleness", str(staleness),
    ]


def _f(row: dict, key: str) -> float | None:
    value = row.get(key, "")
    return float(value) if value not in ("", None) else None


def lit_result(args, root: str) -> dict:
    """Steady-state numbers from the run's metrics CSV."""
    import csv

    with open(os.path.join(root, "logs", "version_0", "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if _f(r, "train/tokens_per_s")]
    by_step = {int(r["step"]): r for r in rows}
    if sorted(by_step) != list(range(args.run_steps)):
        raise RuntimeError(f"{root}: metrics of steps {sorted(by_step)}, expected 0..{args.run_steps - 1}")
    timed = [by_step[k] for k in range(args.warmup, args.total_steps)]
    # train/tokens_per_s = tokens / (end of this step - end of the previous one)
    durations = [_f(r, "train/tokens") / _f(r, "train/tokens_per_s") for r in timed]
    total = sum(durations)
    waits = [_f(r, "train/data_wait_s") for r in timed]
    computes = [_f(r, "train/compute_s") for r in timed]
    # the syncs inside the timed window: after steps warmup-1 .. last-1 (none after the last step)
    syncs = [_f(by_step[k], "train/weight_sync_s") for k in range(args.warmup - 1, args.total_steps - 1)]
    return {
        "step_s": total / len(timed),
        "step_s_each": [round(d, 3) for d in durations],
        "data_wait_s": sum(waits) / len(timed),
        "data_wait_fraction": sum(waits) / total,
        "compute_s": sum(computes) / len(timed),
        "weight_sync_s": sum(syncs) / len(syncs),
        "other_s": (total - sum(waits) - sum(computes) - sum(syncs)) / len(timed),
        "completion_length": statistics.mean(_f(r, "train/completion_length") for r in timed),
        "truncated_fraction": statistics.mean(_f(r, "train/truncated_fraction") for r in timed),
        "staleness_mean": statistics.mean(_f(r, "train/staleness_mean") for r in timed),
        "reward": statistics.mean(_f(r, "train/reward") for r in timed),
        "rows_per_step": statistics.mean(_f(r, "train/rows") for r in timed),
        "server_start_s": _server_start_s(root),
    }


def _server_start_s(root: str) -> float | None:
    """The 'InferenceRuntime: serving ... (N s to start)' line of the run's log, if found."""
    import re

    log = root + ".log"
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            m = re.search(r"InferenceRuntime: serving the weights of step \d+ \((\d+) s to start\)", f.read())
        if m:
            return float(m.group(1))
    return None


# ---- TRL (runs in a child process: `--trl-worker spec.json`) -----------------------------------------
def trl_worker(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import warnings

    warnings.filterwarnings("ignore")
    import datasets
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_rl.rollouts.envs import lcs_ratio

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    with open(spec["prompts"]) as f:
        rows = json.load(f)

    def reverse_text_reward(prompts, completions, text, **kwargs):
        """ReverseTextEnv.reward: LCS ratio of the stripped completion against the reversed text."""
        return [lcs_ratio(c[0]["content"].strip(), t[::-1]) for c, t in zip(completions, text)]

    ticks: list[float] = []
    generate_s: list[float] = []
    pending = {"generate": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **kw)
            finally:
                pending["generate"] += time.perf_counter() - t0

    class Clock(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            ticks.append(time.perf_counter())
            generate_s.append(pending["generate"])
            pending["generate"] = 0.0

    batch = spec["tasks"] * spec["group_size"]
    config = GRPOConfig(
        output_dir=os.path.join(spec["workdir"], "trl_out"),
        use_cpu=True,
        use_vllm=False,
        bf16=False,  # GRPOConfig defaults both on; lit-rl trains float32 without checkpointing
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=spec["mb"],
        gradient_accumulation_steps=batch // spec["mb"],  # steps_per_generation follows: one generation per step
        num_iterations=1,
        num_generations=spec["group_size"],
        max_completion_length=spec["max_tokens"],
        temperature=1.0,
        top_p=1.0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=spec["max_grad_norm"],
        loss_type="dapo",
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        beta=0.0,
        shuffle_dataset=False,  # the prompts are already in lit-rl's draw order
        max_steps=spec["run_steps"],
        logging_steps=1,  # lit-rl logs every step too (log_every_n_steps: 1)
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=spec["seed"],
    )
    if config.generation_batch_size != batch or config.steps_per_generation != config.gradient_accumulation_steps:
        raise RuntimeError(f"TRL would not generate one batch of {batch} per optimizer step: generation_batch_size "
                           f"{config.generation_batch_size}, steps_per_generation {config.steps_per_generation}")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    trainer = TimedGRPOTrainer(
        model=model, reward_funcs=reverse_text_reward, args=config, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(spec["model"]), callbacks=[Clock()],
    )
    trainer.train()
    w, n = spec["warmup"], spec["total_steps"]
    if len(ticks) != spec["run_steps"]:
        raise RuntimeError(f"TRL ran {len(ticks)} optimizer steps, expected {spec['run_steps']}")
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    total = ticks[n - 1] - ticks[w - 1]
    result = {
        "step_s": total / (n - w),
        "step_s_each": [round(b - a, 3) for a, b in zip(ticks[w - 1:n - 1], ticks[w:n])],
        "generate_s": sum(generate_s[w:n]) / (n - w),
        "generate_fraction": sum(generate_s[w:n]) / total,
        "completion_length": statistics.mean(h["completions/mean_length"] for h in logs[w:n]),
        "truncated_fraction": statistics.mean(h["completions/clipped_ratio"] for h in logs[w:n]),
        "reward": statistics.mean(h["reward"] for h in logs[w:n]),
        "torch_threads": torch.get_num_threads(),
    }
    with open(spec["out"], "w") as f:
        json.dump(result, f)


# ---- driver -------------------------------------------------------------------------------------------
def one_run(args, name: str, prep: dict, settings: dict, workdir: str, tag: str) -> dict:
    if name == "trl":
        spec = {"workdir": os.path.join(workdir, tag), "model": prep["model"], "prompts": prep["prompts"],
                "tasks": args.tasks, "group_size": args.group_size, "max_tokens": args.max_tokens, "mb": args.trl_mb,
                "warmup": args.warmup, "total_steps": args.total_steps, "run_steps": args.run_steps, "seed": args.seed,
                "out": os.path.join(workdir, tag + ".json"), **settings}
        os.makedirs(spec["workdir"], exist_ok=True)
        spec_path = os.path.join(workdir, tag + ".spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", spec_path]
        log = os.path.join(workdir, tag + ".log")
        run = run_child(cmd, log, workdir, args.run_timeout)
        if run["rc"] != 0 or not os.path.exists(spec["out"]):
            raise RuntimeError(f"TRL run failed (exit {run['rc']}); the end of its log:\n{_tail(log)}")
        with open(spec["out"]) as f:
            return {**json.load(f), **run}
    root = os.path.join(workdir, tag)
    env = child_env(workdir)
    if name.endswith("_spin1s"):
        env["LIT_RL_VLLM_SPIN_S"] = "1"
    command = lit_command(args, prep, root, int(name[3]))
    if name.endswith("_nobatch"):
        command += ["--inference.batch_prompts", "false"]
    run = run_child(command, root + ".log", workdir, args.run_timeout, env)
    if run["rc"] != 0:
        raise RuntimeError(f"lit-rl run failed (exit {run['rc']}); the end of its log:\n{_tail(root + '.log')}")
    return {**lit_result(args, root), **run}


def summarize(args, runs: dict[str, list[dict]], prep: dict, settings: dict, elapsed: float) -> dict:
    contenders = {}
    for name, results in runs.items():
        if not results:
            continue

        def med(key):
            values = [r.get(key) for r in results]
            return statistics.median(values) if None not in values else None

        c = {
            "label": CONTENDERS[name],
            "step_s_runs": [round(r["step_s"], 3) for r in results],
            "step_s_median": med("step_s"),
            "step_s_each_runs": [r["step_s_each"] for r in results],
            "completion_length_median": med("completion_length"),
            "truncated_fraction_median": med("truncated_fraction"),
            "reward_median": med("reward"),
            "foreign_cores_runs": [None if r["foreign_cores"] is None else round(r["foreign_cores"], 2) for r in results],
            "run_wall_s_runs": [round(r["wall_s"], 1) for r in results],
        }
        if name == "trl":
            c.update(generate_s_median=med("generate_s"), generate_fraction_median=med("generate_fraction"),
                     torch_threads=results[0]["torch_threads"])
        else:
            c.update(data_wait_s_median=med("data_wait_s"), data_wait_fraction_median=med("data_wait_fraction"),
                     compute_s_median=med("compute_s"), weight_sync_s_median=med("weight_sync_s"),
                     other_s_median=med("other_s"), staleness_mean_median=med("staleness_mean"),
                     server_start_s_runs=[r["server_start_s"] for r in results])
        contenders[name] = c
    targets = {}
    trl = contenders.get("trl")
    for name, c in contenders.items():
        if trl:
            c["speedup_vs_trl"] = trl["step_s_median"] / c["step_s_median"]
    for name, bar in TARGETS.items():
        if name in contenders and trl:
            ratio = contenders[name]["speedup_vs_trl"]
            targets[f"{name}_ge_{bar:g}x_trl"] = {"label": CONTENDERS[name], "bar": bar, "ratio": ratio, "met": ratio >= bar}
    import lightning
    import torch
    import transformers
    import trl as trl_pkg

    try:
        import vllm

        vllm_version = vllm.__version__
    except Exception:  # noqa: BLE001 - only for the record
        vllm_version = None
    return {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "lightning": lightning.__version__,
                    "transformers": transformers.__version__, "trl": trl_pkg.__version__, "vllm": vllm_version},
        "settings": {**{k: getattr(args, k) for k in ("rounds", "warmup", "steps", "tasks", "group_size", "batch_size",
                                                     "max_tokens", "trl_mb", "seed", "quiet_wait")},
                     **settings, "model_params": prep["params"], "prompts_checked_same_ids": prep["prompts_checked"]},
        "contenders": contenders,
        "targets": targets,
        "wall_s": round(elapsed, 1),
    }


def markdown(summary: dict) -> str:
    rounds = summary["settings"]["rounds"]
    head = ["contender"] + [f"s/step round {i + 1}" for i in range(rounds)] + [
        "**s/step (median)**", "speed-up vs TRL", "wait-for-data fraction", "weight sync s/step", "compute s/step",
        "completion tokens (mean)", "other procs' cores per run"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for name, c in summary["contenders"].items():
        runs = [f"{x:.2f}" for x in c["step_s_runs"]] + ["-"] * (rounds - len(c["step_s_runs"]))
        if name == "trl":
            wait = f"({c['generate_fraction_median']:.2f} generating)"
            sync, compute = "-", "-"
        else:
            wait = f"{c['data_wait_fraction_median']:.2f}"
            sync, compute = f"{c['weight_sync_s_median']:.3f}", f"{c['compute_s_median']:.2f}"
        lines.append(
            f"| {c['label']} | " + " | ".join(runs) + f" | **{c['step_s_median']:.2f}** | "
            f"{c.get('speedup_vs_trl', float('nan')):.2f}x | {wait} | {sync} | {compute} | "
            f"{c['completion_length_median']:.1f} | "
            f"{', '.join('?' if x is None else f'{x:.2f}' for x in c['foreign_cores_runs'])} |"
        )
    lines.append("")
    for t in summary["targets"].values():
        lines.append(f"- target {t['label']} >= {t['bar']:g}x faster than TRL: TRL s/step / lit-rl s/step = "
                     f"**{t['ratio']:.2f}x** -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return None
    exit_on_sigterm()
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="lit_rl_bench_grpo_")
    try:
        settings = example_settings()
        prep = prepare(args, workdir, settings)
        runs: dict[str, list[dict]] = {c: [] for c in args.contenders}
        for rnd in range(args.rounds):
            order = args.contenders if rnd % 2 == 0 else args.contenders[::-1]
            for name in order:
                waited = wait_until_quiet(args.quiet_wait)
                t0 = time.perf_counter()
                result = one_run(args, name, prep, settings, workdir, f"{name}_r{rnd + 1}")
                runs[name].append(result)
                extra = (f"generating {result['generate_fraction']:.0%}" if name == "trl" else
                         f"waiting for data {result['data_wait_fraction']:.0%}, sync {result['weight_sync_s']:.3f} s, "
                         f"compute {result['compute_s']:.2f} s, server start {result['server_start_s']} s")
                busy = result["foreign_cores"]
                print(f"round {rnd + 1}/{args.rounds} {CONTENDERS[name]:40s} {result['step_s']:.3f} s/step "
                      f"({', '.join(f'{x:.2f}' for x in result['step_s_each'])}; {extra}; completion "
                      f"{result['completion_length']:.1f} tokens; run {time.perf_counter() - t0:.0f} s, waited "
                      f"{waited:.0f} s for a quiet CPU, other processes used {'?' if busy is None else f'{busy:.2f}'} cores)",
                      file=sys.stderr, flush=True)
        summary = summarize(args, runs, prep, settings, time.perf_counter() - start)
    finally:
        if args.keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return report(summary, markdown, args.json)


if __name__ == "__main__":
    main()
