"""`lit-rl report RUN_DIR`: a run's training and eval curves in one PNG, from its CSV logs.

    lit-rl report runs/reverse_text_sft            # writes runs/reverse_text_sft/report.png
    lit-rl report runs/x --out curves.png --metrics train/loss eval/reverse_text/reward

For users without W&B: it reads every `logs/version_*/metrics.csv` (the trainer) and
`eval_metrics.csv` (the evaluator) of the run, resumed launches included.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

from lit_rl.eval.logging import read_eval_metrics

DEFAULT_METRICS = ("train/loss", "train/tokens_per_s", "val/loss")


def collect(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value}; a later launch (a resume) overrides the same step."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for log_dir in sorted(run_dir.glob("logs/version_*"), key=lambda p: int(p.name.split("_")[-1])):
        metrics = log_dir / "metrics.csv"
        if metrics.is_file():
            for row in csv.DictReader(open(metrics)):
                for name, value in row.items():
                    if name not in ("step", "epoch") and value not in ("", None):
                        series[name][int(row["step"])] = float(value)
        for row in read_eval_metrics(log_dir):
            series[row["name"]][row["step"]] = row["value"]
    for row in read_eval_metrics(run_dir / "evals"):  # standalone `lit-rl evaluate` runs
        series[row["name"]][row["step"]] = row["value"]
    return series


def plot(series: dict[str, dict[int, float]], names: list[str], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        points = sorted(series[name].items())
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o" if len(points) < 30 else None)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="lit-rl report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run directory (trainer.default_root_dir of the run)")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/report.png)")
    p.add_argument("--metrics", nargs="*", default=None, help="metrics to plot (default: loss, throughput, evals)")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    series = collect(run_dir)
    if not series:
        raise SystemExit(f"lit-rl report: no metrics.csv or eval_metrics.csv under {run_dir}")
    if args.metrics:
        missing = [m for m in args.metrics if m not in series]
        if missing:
            raise SystemExit(f"lit-rl report: no such metric(s) {missing}; found {sorted(series)}")
        names = args.metrics
    else:
        evals = sorted(n for n in series if n.startswith("eval/") and not n.endswith("/policy_version"))
        names = [n for n in DEFAULT_METRICS if n in series] + evals
    out = Path(args.out) if args.out else run_dir / "report.png"
    plot(series, names, out, title=str(run_dir))
    print(f"wrote {out} ({', '.join(names)})")
