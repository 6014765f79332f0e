"""TRL's trainers in a child process, for the learning benches (`bench/distillation.py`'s `trl`
and `trl_grpo`): the spec handed over as a JSON file, the run with its log beside the run
directory, an HF export every `every` steps that is scored like lit-rl's, and the speed the
child reports (seconds per optimizer step after the first, peak resident set)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from contextlib import contextmanager

from _common import REPO


def run_child(command: list[str], spec: dict, root: str, label: str) -> tuple[float, dict]:
    """`python *command spec.json` from the repo root, logging to `root.log`; its wall time and
    the JSON it wrote to `spec["out"]`."""
    spec_path = os.path.join(root, "trl_spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with open(root + ".log", "w") as log:
        proc = subprocess.run([sys.executable, *command, spec_path], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {proc.returncode}); see {root}.log")
    with open(spec["out"]) as f:
        return time.perf_counter() - started, json.load(f)


def read_spec(spec_path: str) -> dict:
    """The child's spec, with TRL's and its dependencies' warnings and progress bars off."""
    import warnings

    warnings.filterwarnings("ignore")
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    with open(spec_path) as f:
        return json.load(f)


def export_and_clock(spec: dict, tokenizer, ticks: list[float]):
    """A callback that notes when each optimizer step ends and exports the model every
    `spec["every"]` steps and at the last, into `<root>/weights/step_N` (marked STABLE)."""
    from transformers import TrainerCallback

    class ExportAndClock(TrainerCallback):
        def on_step_end(self, args_, state, control, model=None, **kwargs):
            ticks.append(time.perf_counter())
            if state.global_step % spec["every"] == 0 or state.global_step == spec["steps"]:
                out = os.path.join(spec["root"], "weights", f"step_{state.global_step}")
                model.save_pretrained(out)
                tokenizer.save_pretrained(out)
                open(os.path.join(out, "STABLE"), "w").close()

    return ExportAndClock()


def write_speed(spec: dict, ticks: list[float]) -> None:
    """Check the run took `spec["steps"]` steps; write its seconds per step and peak RSS."""
    if len(ticks) != spec["steps"]:
        raise RuntimeError(f"TRL ran {len(ticks)} optimizer steps, expected {spec['steps']}")
    spans = [b - a for a, b in zip(ticks, ticks[1:])]
    with open(spec["out"], "w") as f:
        json.dump({"step_s": sum(spans) / max(len(spans), 1),
                   "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}, f)


@contextmanager
def recording(trainer, path: str | None, keys: tuple[str, ...], extra=None):
    """With `path`, keep every generation batch the trainer trains on, as generated (a GRPO
    group's completions consecutive, before TRL shuffles them into micro-batches): the tensors
    `keys` of TRL's `_generate_and_score_completions`, and `extra()`'s entries; written to
    `path` as JSON when the block ends. Without `path`, nothing is recorded."""
    if not path:
        yield
        return
    batches: list[dict] = []
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        out = generate(inputs)
        if trainer.model.training:
            batches.append({**{k: out[k].tolist() for k in keys}, **(extra() if extra else {})})
        return out

    trainer._generate_and_score_completions = recorded
    yield
    with open(path, "w") as f:
        json.dump(batches, f)
