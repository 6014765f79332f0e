"""Where the evaluator's metrics go: the trainer's own run.

CSV (default): `<log_dir>/eval_metrics.csv` beside the trainer's `metrics.csv` in the
same Lightning log directory, one row per metric (step, name, value). A separate file,
because two processes appending to one CSV would interleave rows.

W&B: when the trainer logs to W&B, the evaluator joins the same run (`resume="allow"`
with the trainer's run id) and logs `eval/*` against `eval/policy_version`.
"""

from __future__ import annotations

import csv
import io
import logging
import time
from pathlib import Path

from lit_rl.run_dir import ends_mid_line

FIELDS = ["step", "name", "value", "time"]
log = logging.getLogger(__name__)


class EvalLogger:
    def __init__(self, log_dir: str | Path, wandb_run: dict | None = None):
        self.path = Path(log_dir) / "eval_metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._wandb = None
        if wandb_run:
            from lit_rl.eval.wandb_shared import join_as_evaluator

            try:
                self._wandb = join_as_evaluator(wandb_run)
            except Exception as e:  # noqa: BLE001 - evals still count without W&B
                log.error("evaluator: could not join the trainer's W&B run %s (%s: %s); eval metrics go to %s only",
                          wandb_run.get("id"), type(e).__name__, e, self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path, "a+", newline="") as f:  # + : read access, for the last byte
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if ends_mid_line(f.fileno()):  # a row cut short (a full disk): it stays alone on its line
                f.write("\n")
            if f.tell() == 0:  # also a file left empty: without the header no row of it could be read
                writer.writeheader()
            now = time.time()
            for name, value in metrics.items():
                writer.writerow({"step": step, "name": name, "value": value, "time": now})
        if self._wandb is not None:
            self._wandb.log({**metrics, "eval/policy_version": step, "trainer/global_step": step})

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def appended_rows(path: str | Path) -> list[dict]:
    """The rows of a CSV file a logger appends to (the trainer's `metrics.csv`, `eval_metrics.csv`;
    none when there is none). A last row without its line end was cut short (a full disk, or a
    crash, while it was appended) and is left out: a number cut short is not read as another one,
    nor fails the reader."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return list(csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1])))


def read_eval_metrics(log_dir: str | Path) -> list[dict]:
    """The rows of `eval_metrics.csv`, less those cut short: a row is whole when its last field
    (`time`) is there, so a value cut to fewer digits (0.72 written as 0.7) is never read as a
    measurement, and a row cut inside its name does not stop `lit-rl report`."""
    rows = []
    for r in appended_rows(Path(log_dir) / "eval_metrics.csv"):
        try:
            if r.get("time"):
                rows.append({"step": int(r["step"]), "name": r["name"], "value": float(r["value"])})
        except (TypeError, ValueError):
            continue
    return rows
