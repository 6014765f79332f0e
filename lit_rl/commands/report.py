"""`lit-rl report RUN_DIR [RUN_DIR ...]`: training and eval curves in one PNG, from CSV logs.

    lit-rl report runs/reverse_text_sft            # writes runs/reverse_text_sft/report.png
    lit-rl report runs/x --out curves.png --metrics train/loss eval/reverse_text/reward
    lit-rl report runs/bench/opd runs/bench/grpo   # overlays the runs: runs/bench/report.png

For users without W&B: it reads every `logs/version_*/metrics.csv` (the trainer) and
`eval_metrics.csv` (the evaluator) of the run, resumed launches included. A fresh `fit` in the
same directory (no `ckpt_path`) starts the curves again: the launches before it trained weights
that run replaced. A `lit-rl validate` launch is drawn at the step of the checkpoint it validated
(where the fit's own validation of it would be), or left out when that step is unknown.
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections import defaultdict
from pathlib import Path

from lit_rl.eval.logging import appended_rows, read_eval_metrics

DEFAULT_METRICS = ("train/loss", "train/tokens_per_s", "val/loss")


def collect(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value}; a later launch (a resume) overrides the same step, and a later
    fresh training run replaces what came before it. A launch that trained nothing (`lit-rl
    validate`, which Lightning logs at step 0) is drawn at the step of the weights it validated
    (`validated_step`), or left out when that is unknown."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for log_dir in launches(run_dir):
        rows = appended_rows(log_dir / "metrics.csv")
        saved = saved_config(log_dir)
        trained = any(k.startswith("train/") and v not in ("", None) for r in rows for k, v in r.items())
        if trained and saved is not None and "ckpt_path" in saved and saved["ckpt_path"] is None:
            series.clear()  # a fresh training run: the launches before it trained weights it replaced
        at = None if trained else validated_step(run_dir, log_dir, saved)
        if not trained and at is None:
            rows = []
        for row in rows:
            for name, value in row.items():
                if name not in ("step", "epoch") and value not in ("", None):
                    series[name][int(row["step"]) if at is None else at] = float(value)
        for row in read_eval_metrics(log_dir):
            series[row["name"]][row["step"]] = row["value"]
    for row in read_eval_metrics(run_dir / "evals"):  # standalone `lit-rl evaluate` runs
        series[row["name"]][row["step"]] = row["value"]
    return series


def launches(run_dir: Path) -> list[Path]:
    """The `logs/version_N` directories Lightning's CSVLogger wrote, oldest first; other folders
    there (a user's `version_0_old`) are not launches of this run."""
    found = [(int(m.group(1)), p) for p in run_dir.glob("logs/version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
    return [p for _, p in sorted(found)]


def saved_config(log_dir: Path) -> dict | None:
    """The config the launch saved (LightningCLI's `config.yaml`), or None."""
    import yaml

    try:
        saved = yaml.safe_load((log_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def validated_step(run_dir: Path, log_dir: Path, saved: dict | None) -> int | None:
    """Where to draw what a launch that trained nothing logged: at the step where a fit logs its own
    validation of the same weights (N - 1 for a checkpoint of N optimizer steps: Lightning numbers
    logged steps from 0), so a validated checkpoint lands on the curve where it was trained. Step 0
    without a checkpoint (the config's model, untrained). None, left out, when the step is unknown:
    no saved config, a checkpoint that is gone or was rewritten after the launch (a later resume
    saved `last.ckpt` again), or one that cannot be read."""
    if saved is None or "ckpt_path" not in saved:
        return None
    if saved["ckpt_path"] is None:
        return 0
    path = run_dir / "checkpoints" / "last.ckpt" if saved["ckpt_path"] == "last" else Path(saved["ckpt_path"])
    named = re.search(r"step=(\d+)", path.name)  # Lightning's ModelCheckpoint names: epoch=0-step=100.ckpt
    step = int(named.group(1)) if named else checkpoint_step(path, written_before=log_dir / "metrics.csv")
    return None if step is None else max(step - 1, 0)


def checkpoint_step(path: Path, written_before: Path) -> int | None:
    """The optimizer step a checkpoint was saved at, if it is still the file it was when
    `written_before` was written. Read with mmap: the weights are not loaded."""
    meta = path / "meta.pt" if path.is_dir() else path  # a sharded checkpoint keeps its step in meta.pt
    try:
        if meta.stat().st_mtime > written_before.stat().st_mtime:
            return None
        import torch

        return int(torch.load(meta, map_location="cpu", mmap=True, weights_only=True)["global_step"])
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, EOFError, pickle.UnpicklingError):
        return None


def out_path(given: str) -> Path:
    """`--out` as the file matplotlib will write: one without a suffix gets `.png` (matplotlib adds it
    itself, and the path printed was not the file written); a suffix matplotlib cannot write is refused
    before anything is drawn (it was a traceback from inside matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    out = Path(given)
    if not out.suffix:
        return out.with_name(out.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise SystemExit(f"lit-rl report: --out {given}: matplotlib cannot write {out.suffix!r} files; "
                         f"give one of {', '.join('.' + f for f in sorted(formats))}")
    return out


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
        out = out_path(args.out)
    else:
        out = run_dirs[0] / "report.png" if len(run_dirs) == 1 else run_dirs[0].parent / "report.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    drawn = plot(runs, names, out, title=str(run_dirs[0]) if len(run_dirs) == 1 else f"{len(run_dirs)} runs")
    print(f"wrote {out} ({', '.join(names)})")
    for name, labels in drawn.items():
        if len(run_dirs) > 1 and len(labels) < len(run_dirs):
            print(f"  {name}: only in {', '.join(labels)}")
