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

from lit_rl.run_dir import ends_mid_line


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
    # seconds one environment's eval of one step may take; past it that eval is recorded as failed and
    # the evaluator goes on (None: no limit). A plan.json written before it existed reads as the default.
    eval_timeout: float | None = 1800.0

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
    not repeat evals already done. A line that does not read back (the evaluator killed while
    writing it, a full disk) is left out: that eval is due again, and nothing else is lost."""

    def __init__(self, root: str | Path):
        self.path = evals_dir(root) / "done.jsonl"
        self.records: dict[tuple[int, str], dict] = {}  # each (step, env)'s last line, its error included
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    e = json.loads(line)
                    key, status = (int(e["step"]), str(e["env"])), e["status"]
                except (ValueError, KeyError, TypeError):
                    continue
                if isinstance(status, str):
                    self.records[key] = e

    @property
    def entries(self) -> dict[tuple[int, str], str]:
        return {k: e["status"] for k, e in self.records.items()}

    def record(self, step: int, env: str, status: str, **extra) -> None:
        entry = {"step": step, "env": env, "status": status, **extra}
        self.records[(step, env)] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            torn = ends_mid_line(fd)  # a line cut short: this one starts afresh
            os.write(fd, (("\n" if torn else "") + json.dumps(entry) + "\n").encode())  # one write, one line
        finally:
            os.close(fd)

    def handled(self, step: int, env: str) -> bool:
        return (step, env) in self.records

    def forget_after(self, step: int) -> None:
        """On resume from `step`, evals of later steps belong to a discarded future."""
        kept = {k: e for k, e in self.records.items() if k[0] <= step}
        if kept != self.records:
            self.records = kept
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.path, "".join(json.dumps(e) + "\n" for e in kept.values()))
