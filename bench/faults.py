#!/usr/bin/env python
"""Soak: a GRPO run whose policy server is killed again and again, against the same run undisturbed.

Both runs are `examples/reverse_text/grpo.yaml` from the same weak student (the SFT demo stopped
at step 40), with the same seed, on this machine's CPU with the vLLM server lit-rl starts. In the
faulted run a thread injects `--kills` faults into the policy's server at seeded moments (after
a random step, a random fraction of a second later), cycling through four kinds:

  engine   SIGKILL to the server's engine process (the worker); its API process stays up, broken
  api      SIGKILL to the API process alone; its engine is left behind, orphaned
  server   SIGKILL to the whole server (API process and engine, its process group)
  hang     SIGSTOP to the whole server: alive, but it answers nothing (not even /health)

with `--inference.max_server_restarts` equal to the number of kills. The script reports the kills
made and survived (the run finished all its steps, exit 0), each restart's time as the run logged
it ("... is back ... (N s)"), what found each fault (the weight sync's requests, a rollout's, or
the watchdog: the run's log says), how many rollouts in flight were made again on a restarted
server (`rollout/reissued`: kills that landed mid-generation), the wall time of both runs, and
the held-out reward of both final exports (greedy, and the mean of 4 samples at temperature 1;
examples/reverse_text/exact_match.py).

    .venv/bin/python bench/faults.py                      # 40 steps, 4 kills
    .venv/bin/python bench/faults.py --steps 100 --kills 8 --max-staleness 1 --json faults.json
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from _common import STUDENT, require_checkpoint  # noqa: E402
from distillation import HELD_OUT, REPO, score  # noqa: E402

KINDS = ("engine", "api", "server", "hang")
SYNC_REQUESTS = ("pause", "reload_weights", "reset_prefix_cache", "resume", "update_weight_version")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", default=STUDENT)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--max-staleness", type=int, default=0,
                   help="the runs' data.max_staleness: 1 overlaps rollouts with training, so faults hit generation")
    p.add_argument("--seed", type=int, default=0, help="the runs' seed and the kills' moments")
    p.add_argument("--samples", type=int, default=4, help="completions per held-out prompt for the sampled reward")
    p.add_argument("--out", default="runs/faults_bench")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    require_checkpoint(p, "--student", args.student, demo="run_grpo_demo.sh")
    return args


def server_pids(root: str) -> tuple[int | None, list[int]]:
    """The policy server's API process and its children (the engine), or (None, [])."""
    found = subprocess.run(["pgrep", "-f", f"vllm_main --model {root}"], capture_output=True, text=True).stdout.split()
    pids = [int(p) for p in found]
    parents = {p: int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) for p in pids if os.path.exists(f"/proc/{p}")}
    api = next((p for p, parent in parents.items() if parent not in parents), None)
    if api is None:
        return None, []
    children = subprocess.run(["pgrep", "-P", str(api)], capture_output=True, text=True).stdout.split()
    return api, [int(c) for c in children]


def steps_done(root: str) -> int:
    path = os.path.join(root, "rollouts", "trained.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def restarts_done(log_path: str) -> int:
    with open(log_path, errors="replace") as f:
        return f.read().count("vLLM server is back, serving")


def inject(root: str, proc: subprocess.Popen, plan: list[tuple[int, float, str]], made: list[dict]) -> None:
    """The fault thread: for each (step, delay, kind), wait for the step, then the fault; then
    wait until the run says the server is back, so that no fault hits a server still starting
    (a server that hangs while it starts is waited for up to its `startup_timeout`, 600 s)."""
    for step, delay, kind in plan:
        while steps_done(root) < step:
            if proc.poll() is not None:
                return
            time.sleep(0.2)
        time.sleep(delay)
        api, engine = server_pids(root)
        if api is None:
            made.append({"step": step, "kind": kind, "made": False})
            continue
        if kind == "engine":
            for pid in engine:
                os.kill(pid, signal.SIGKILL)
        elif kind == "api":
            os.kill(api, signal.SIGKILL)
        else:
            os.killpg(os.getpgid(api), signal.SIGKILL if kind == "server" else signal.SIGSTOP)
        made.append({"step": steps_done(root), "kind": kind, "made": True, "at": time.monotonic()})
        while restarts_done(root + ".log") < sum(k["made"] for k in made) and proc.poll() is None:  # until its replacement serves
            time.sleep(0.5)


def found_by_of(line: str) -> str:
    """Which request found a fault, from the run's "restarting it" line."""
    m = re.search(r"the error that found it: (\w+):", line)
    if m is None:
        return "watchdog"
    return "weight sync" if m.group(1) in SYNC_REQUESTS else m.group(1)


def last_logged(root: str, name: str) -> float | None:
    """The last value of a metric in the run's CSV log."""
    values = [row[name] for path in sorted(glob.glob(os.path.join(root, "logs", "version_*", "metrics.csv")))
              for row in csv.DictReader(open(path)) if row.get(name)]
    return float(values[-1]) if values else None


def run(args, name: str, kills: int) -> dict:
    root = os.path.abspath(os.path.join(args.out, name))
    subprocess.run(["rm", "-rf", root])
    os.makedirs(args.out, exist_ok=True)
    cmd = [os.path.join(REPO, ".venv", "bin", "lit-rl"), "fit", "--config", "examples/reverse_text/grpo.yaml",
           "--model.init_args.model", args.student, "--trainer.default_root_dir", root,
           "--trainer.max_steps", str(args.steps), "--seed_everything", str(args.seed),
           "--data.init_args.max_staleness", str(args.max_staleness),
           "--trainer.enable_progress_bar", "false", "--inference.max_server_restarts", str(kills),
           "--trainer.callbacks.init_args.every_n_steps", str(args.steps)]
    rng = random.Random(f"faults:{args.seed}")
    steps = sorted(rng.sample(range(1, args.steps - 1), kills)) if kills else []
    plan = [(s, rng.uniform(0.0, 2.0), KINDS[i % len(KINDS)]) for i, s in enumerate(steps)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    made: list[dict] = []
    started = time.perf_counter()
    with open(root + ".log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        thread = threading.Thread(target=inject, args=(root, proc, plan, made), daemon=True)
        thread.start()
        code = proc.wait()
    wall = time.perf_counter() - started
    text = open(root + ".log").read()
    back = [float(s) for s in re.findall(r"vLLM server is back, serving .*? \((\d+) s\)", text)]
    found_by = [found_by_of(line) for line in text.splitlines() if "restarting it (restart" in line]
    final = os.path.join(root, "weights", f"step_{args.steps}")
    result = {"exit": code, "steps": steps_done(root), "wall_s": wall, "kills": made, "restart_s": back,
              "restarts_logged": text.count("restarting it (restart"), "found_by": found_by,
              "reissued": last_logged(root, "rollout/reissued")}
    if code == 0 and os.path.isfile(os.path.join(final, "STABLE")):
        result["held_out"] = score(final, HELD_OUT, samples=args.samples)
    print(f"{name}: exit {code}, {result['steps']} steps in {wall:.0f} s, kills {[(k['step'], k['kind']) for k in made]}, "
          f"restarts {back} s, found by {found_by}, rollouts reissued {result['reissued']}, "
          f"held-out {result.get('held_out')}", flush=True)
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    results = {"undisturbed": run(args, "undisturbed", 0), "faulted": run(args, "faulted", args.kills)}
    hit = results["faulted"]
    made = [k for k in hit["kills"] if k["made"]]
    survived = len(made) if hit["exit"] == 0 and hit["steps"] == args.steps else 0
    print("\n| run | exit | steps | faults made (after step, kind) | restarts, s each | found by | rollouts reissued "
          "| held-out greedy | held-out sampled | wall |\n|---|---:|---:|---|---|---|---:|---:|---:|---:|")
    for name, r in results.items():
        h = r.get("held_out") or {}
        faults = ", ".join(f"{k['step']} {k['kind']}" for k in r["kills"] if k["made"]) or "-"
        restarts = ", ".join(f"{s:.0f}" for s in r["restart_s"]) or "-"
        found = ", ".join(r["found_by"]) or "-"
        print(f"| {name} | {r['exit']} | {r['steps']} | {faults} | {restarts} | {found} | {r['reissued'] or 0:.0f} "
              f"| {h.get('reward', float('nan')):.3f} "
              f"| {h.get('sampled_reward', float('nan')):.3f} | {r['wall_s']:.0f} s |")
    print(f"faults survived / made: {survived} / {len(made)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": results, "survived": survived, "made": len(made)}, f, indent=2)


if __name__ == "__main__":
    main()
