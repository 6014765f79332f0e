"""Optimizer steps per second of the reverse-text SFT demo with online evals on and off.

    .venv/bin/python bench/online_eval.py [--steps 300] [--interval 50] [--rounds 1] [--pin 0:1]

"On" is `examples/reverse_text/sft_online_eval.yaml` (an evaluator process with its own
vLLM server, evaluating every `--interval` steps); "off" is the same config without the
OnlineEval callback. Both runs train the same model on the same data; they alternate,
`--rounds` times each. Steps/s is measured from step 10 to the last step (the first steps
include warm-up). On a machine where trainer and evaluator do not share cores the cost
should be near zero; on a 2-core machine they compete for the same cores, and the
numbers say how much. `--pin TRAIN:EVAL` (core lists such as `0:1` or `0-3:4-7`) gives each
side its own cores: the trainer runs on TRAIN with one torch thread per core and rendering
inline (no DataLoader worker), in both the on and the off runs, and the evaluator and its
vLLM server on EVAL (`OnlineEval.cpus`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from lit_rl.child_process import dies_with_parent

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "reverse_text" / "sft_online_eval.yaml"


def steps_per_second(timer_file: Path, skip: int = 10) -> float:
    points = [tuple(map(float, line.split())) for line in timer_file.read_text().splitlines()]
    points = [(s, t) for s, t in points if s >= skip]
    (s0, t0), (s1, t1) = points[0], points[-1]
    return (s1 - s0) / (t1 - t0)


def cores(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def run(tmp: Path, data: Path, steps: int, interval: int, evals: bool, tag: str, pin: tuple | None) -> float:
    config = yaml.safe_load(EXAMPLE.read_text())
    timer = tmp / f"{tag}.steps"
    config["trainer"].update(max_steps=steps, default_root_dir=str(tmp / tag), enable_progress_bar=False)
    callbacks = config["trainer"]["callbacks"]
    callbacks[1]["init_args"]["interval"] = interval
    for env in callbacks[1]["init_args"]["envs"]:
        env["init_args"]["path"] = str(data / "test.jsonl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pin:
        callbacks[1]["init_args"]["cpus"] = pin[1]
        config["data"]["init_args"]["num_workers"] = 0
        env["OMP_NUM_THREADS"] = str(len(pin[0]))
    if not evals:
        callbacks.pop(1)
    callbacks.append({"class_path": "bench.step_timer.StepTimer", "init_args": {"path": str(timer)}})
    config["model"]["init_args"]["lr_scheduler"]["init_args"]["total_steps"] = steps
    config["data"]["init_args"]["path"] = str(data / "train.jsonl")
    path = tmp / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "lit_rl.cli", "fit", "--config", str(path)]
    out = subprocess.run(dies_with_parent(command, pin[0] if pin else None), cwd=REPO, env=env, capture_output=True,
                         text=True)  # pinned by the launcher that also starts the evaluator and vLLM
    if out.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{out.stderr[-3000:]}")
    return steps_per_second(timer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--interval", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pin", default=None, help="TRAIN:EVAL core lists, e.g. 0:1")
    args = parser.parse_args()
    pin = tuple(cores(side) for side in args.pin.split(":")) if args.pin else None
    with tempfile.TemporaryDirectory(prefix="lit_rl_bench_evals_") as tmp_name:
        tmp = Path(tmp_name)
        subprocess.run([sys.executable, "examples/reverse_text/make_data.py", "--out", str(tmp / "data")], cwd=REPO,
                       check=True, capture_output=True)
        on, off = [], []
        for r in range(args.rounds):
            off.append(run(tmp, tmp / "data", args.steps, args.interval, False, f"off{r}", pin))
            on.append(run(tmp, tmp / "data", args.steps, args.interval, True, f"on{r}", pin))
            print(json.dumps({"round": r, "steps_per_s_off": round(off[-1], 3), "steps_per_s_on": round(on[-1], 3)}), flush=True)
    a, b = statistics.median(off), statistics.median(on)
    print(json.dumps({"cores": os.cpu_count(), "pin": args.pin, "steps": args.steps, "interval": args.interval,
                      "steps_per_s_off": round(a, 3), "steps_per_s_on": round(b, 3), "slowdown": round(1 - b / a, 3)}))


if __name__ == "__main__":
    main()
