"""`lit-rl report RUN_DIR [RUN_DIR ...]`: training and eval curves in one PNG, from CSV logs.

    lit-rl report runs/reverse_text_sft            # writes runs/reverse_text_sft/report.png
    lit-rl report runs/x --out curves.png --metrics train/loss eval/reverse_text/reward
    lit-rl report runs/bench/opd runs/bench/grpo   # overlays the runs: runs/bench/report.png

For users without W&B: it reads every `logs/version_*/metrics.csv` (the trainer) and
`eval_metrics.csv` (the evaluator) of the run, resumed launches included. A fresh `fit` in the
same directory (no `ckpt_path`) starts the curves again: the launches before it trained weights
that run replaced.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

from lit_rl.eval.logging import read_eval_metrics

DEFAULT_METRICS = ("train/loss", "train/tokens_per_s", "val/loss")


def collect(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value}; a later launch (a resume) overrides the same step, and a later
    fresh training run replaces what came before it."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for log_dir in sorted(run_dir.glob("logs/version_*"), key=lambda p: int(p.name.split("_")[-1])):
        rows = list(csv.DictReader(open(log_dir / "metrics.csv"))) if (log_dir / "metrics.csv").is_file() else []
        if fresh_training(log_dir, rows):
            series.clear()
        for row in rows:
            for name, value in row.items():
                if name not in ("step", "epoch") and value not in ("", None):
                    series[name][int(row["step"])] = float(value)
        for row in read_eval_metrics(log_dir):
            series[row["name"]][row["step"]] = row["value"]
    for row in read_eval_metrics(run_dir / "evals"):  # standalone `lit-rl evaluate` runs
        series[row["name"]][row["step"]] = row["value"]
    return series


def fresh_training(log_dir: Path, rows: list[dict]) -> bool:
    """Whether the launch logged here trained from the start: its saved config has no
    `ckpt_path` and it logged training metrics (a `lit-rl validate` logs none)."""
    import yaml

    config = log_dir / "config.yaml"
    if not config.is_file() or not any(k.startswith("train/") and v not in ("", None) for r in rows for k, v in r.items()):
        return False
    try:
        saved = yaml.safe_load(config.read_text()) or {}
    except yaml.YAMLError:
        return False
    return isinstance(saved, dict) and "ckpt_path" in saved and saved["ckpt_path"] is None


def plot(runs: dict[str, dict[str, dict[int, float]]], names: list[str], out: Path, title: str) -> dict[str, list[str]]:
    """One panel per metric, one line per run that has it (a legend when there are several
    runs). Returns, per metric, the runs drawn in its panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn: dict[str, list[str]] = {}
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        drawn[name] = [label for label, series in runs.items() if series.get(name)]
        for label in drawn[name]:
            points = sorted(runs[label][name].items())
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o" if len(points) < 30 else None, label=label)
        if len(runs) > 1:
            ax.legend(fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Short legend names: each run's directory name, or its whole path when two names clash."""
    names = [d.name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="lit-rl report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="+", help="run directories (trainer.default_root_dir); several are overlaid")
    p.add_argument("--out", default=None,
                   help="PNG path (default: RUN_DIR/report.png; with several runs, report.png beside the first)")
    p.add_argument("--metrics", nargs="*", default=None, help="metrics to plot (default: loss, throughput, evals)")
    args = p.parse_args(argv)
    run_dirs = [Path(d) for d in args.run_dir]
    runs = {label: collect(d) for label, d in zip(run_labels(run_dirs), run_dirs)}
    empty = [str(d) for d, series in zip(run_dirs, runs.values()) if not series]
    if empty:
        raise SystemExit(f"lit-rl report: no metrics.csv or eval_metrics.csv under {', '.join(empty)}")
    found = sorted({name for series in runs.values() for name in series})
    if args.metrics:
        missing = [m for m in args.metrics if m not in found]
        if missing:
            raise SystemExit(f"lit-rl report: no such metric(s) {missing} in any run; found {found}")
        names = args.metrics
    else:
        evals = [n for n in found if n.startswith("eval/") and not n.endswith("/policy_version")]
        names = [n for n in DEFAULT_METRICS if n in found] + evals
    if args.out:
        out = Path(args.out)
    else:
        out = run_dirs[0] / "report.png" if len(run_dirs) == 1 else run_dirs[0].parent / "report.png"
    drawn = plot(runs, names, out, title=str(run_dirs[0]) if len(run_dirs) == 1 else f"{len(run_dirs)} runs")
    print(f"wrote {out} ({', '.join(names)})")
    for name, labels in drawn.items():
        if len(run_dirs) > 1 and len(labels) < len(run_dirs):
            print(f"  {name}: only in {', '.join(labels)}")
