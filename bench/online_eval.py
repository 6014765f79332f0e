"""Optimizer steps per second of the reverse-text SFT demo with online evals on and off.

    .venv/bin/python bench/online_eval.py [--steps 300] [--interval 50] [--rounds 1]

"On" is `examples/reverse_text/sft_online_eval.yaml` (an evaluator process with its own
vLLM server, evaluating every `--interval` steps); "off" is the same config without the
OnlineEval callback. Both runs train the same model on the same data; they alternate,
`--rounds` times each. Steps/s is measured from step 10 to the last step (the first steps
include warm-up). On a machine where trainer and evaluator do not share cores the cost
should be near zero; on a 2-core machine they compete for the same cores, and the
numbers say how much.
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

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "reverse_text" / "sft_online_eval.yaml"


def steps_per_second(timer_file: Path, skip: int = 10) -> float:
    points = [tuple(map(float, line.split())) for line in timer_file.read_text().splitlines()]
    points = [(s, t) for s, t in points if s >= skip]
    (s0, t0), (s1, t1) = points[0], points[-1]
    return (s1 - s0) / (t1 - t0)


def run(tmp: Path, data: Path, steps: int, interval: int, evals: bool, tag: str) -> float:
    config = yaml.safe_load(EXAMPLE.read_text())
    timer = tmp / f"{tag}.steps"
    config["trainer"].update(max_steps=steps, default_root_dir=str(tmp / tag), enable_progress_bar=False)
    callbacks = config["trainer"]["callbacks"]
    callbacks[1]["init_args"]["interval"] = interval
    for env in callbacks[1]["init_args"]["envs"]:
        env["init_args"]["path"] = str(data / "test.jsonl")
    if not evals:
        callbacks.pop(1)
    callbacks.append({"class_path": "bench.step_timer.StepTimer", "init_args": {"path": str(timer)}})
    config["model"]["init_args"]["lr_scheduler"]["init_args"]["total_steps"] = steps
    config["data"]["init_args"]["path"] = str(data / "train.jsonl")
    path = tmp / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "lit_rl.cli", "fit", "--config", str(path)], cwd=REPO, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{out.stderr[-3000:]}")
    return steps_per_second(timer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--interval", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lit_rl_bench_evals_") as tmp_name:
        tmp = Path(tmp_name)
        subprocess.run([sys.executable, "examples/reverse_text/make_data.py", "--out", str(tmp / "data")], cwd=REPO,
                       check=True, capture_output=True)
        on, off = [], []
        for r in range(args.rounds):
            off.append(run(tmp, tmp / "data", args.steps, args.interval, False, f"off{r}"))
            on.append(run(tmp, tmp / "data", args.steps, args.interval, True, f"on{r}"))
            print(json.dumps({"round": r, "steps_per_s_off": round(off[-1], 3), "steps_per_s_on": round(on[-1], 3)}), flush=True)
    a, b = statistics.median(off), statistics.median(on)
    print(json.dumps({"cores": os.cpu_count(), "steps": args.steps, "interval": args.interval,
                      "steps_per_s_off": round(a, 3), "steps_per_s_on": round(b, 3), "slowdown": round(1 - b / a, 3)}))


if __name__ == "__main__":
    main()
