"""The hand-off between the trainer and the evaluator, through files under `<root>/evals/`.

    plan.json          which environments, their intervals, whether step 0 is evaluated
    final_step         written by the trainer after its last export: the last step to evaluate
    done.jsonl         one line per (step, env) the evaluator has handled: ok, failed or skipped
    step_<N>/<env>.jsonl   per-sample traces (prompt, completion, reward)

Training never waits on any of it: the filesystem is the only channel, and the run
directory's STABLE protocol (lit_rl/run_dir.py) says which checkpoints are complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


def evals_dir(root: str | Path) -> Path:
    return Path(root) / "evals"


@dataclass
class EvalPlan:
    envs: list[dict]  # {"class_path", "init_args"} of each environment
    interval: int = 100
    intervals: dict[str, int] = field(default_factory=dict)  # per environment name
    eval_base: bool = True
    # the chat template's variables the training data renders with (enable_thinking, ...): eval prompts
    # are rendered the same way, or a model trained without thinking would be evaluated thinking
    chat_template_kwargs: dict = field(default_factory=dict)

    def interval_of(self, name: str) -> int:
        return int(self.intervals.get(name, self.interval))

    def due(self, step: int, names: list[str], final_step: int | None) -> list[str]:
        """The environments due at `step`: every one at step 0 (when eval_base) and at the final
        step; otherwise those whose interval divides the step."""
        if step == 0:
            return list(names) if self.eval_base else []
        if step == final_step:
            return list(names)
        return [n for n in names if step % self.interval_of(n) == 0]

    def save(self, root: str | Path) -> Path:
        path = evals_dir(root) / "plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> EvalPlan:
        data = json.loads(Path(path).read_text())
        return cls(**data)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_final_step(root: str | Path, step: int) -> None:
    path = evals_dir(root) / "final_step"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, str(step))


def read_final_step(root: str | Path) -> int | None:
    path = evals_dir(root) / "final_step"
    return int(path.read_text()) if path.is_file() else None


def clear_final_step(root: str | Path) -> None:
    (evals_dir(root) / "final_step").unlink(missing_ok=True)


class DoneLog:
    """Which (step, env) the evaluator has handled; survives restarts, so a resumed run does
    not repeat evals already done."""

    def __init__(self, root: str | Path):
        self.path = evals_dir(root) / "done.jsonl"
        self.entries: dict[tuple[int, str], str] = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    e = json.loads(line)
                    self.entries[(int(e["step"]), e["env"])] = e["status"]

    def record(self, step: int, env: str, status: str, **extra) -> None:
        self.entries[(step, env)] = status
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "env": env, "status": status, **extra}) + "\n")

    def handled(self, step: int, env: str) -> bool:
        return (step, env) in self.entries

    def forget_after(self, step: int) -> None:
        """On resume from `step`, evals of later steps belong to a discarded future."""
        kept = {k: v for k, v in self.entries.items() if k[0] <= step}
        if kept != self.entries:
            self.entries = kept
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.path, "".join(json.dumps({"step": s, "env": e, "status": st}) + "\n" for (s, e), st in kept.items()))
