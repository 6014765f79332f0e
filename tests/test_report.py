"""`lit-rl report` over real CSV logs: one run, and several runs overlaid on shared panels."""

import csv

import pytest

from lit_rl.commands.report import collect, main, plot, run_labels
from lit_rl.eval.logging import EvalLogger


def write_run(root, losses, evals=None):
    """A run directory as a training run leaves it: Lightning's metrics.csv, and eval rows."""
    log_dir = root / "logs" / "version_0"
    log_dir.mkdir(parents=True)
    with open(log_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["epoch", "step", "train/loss"])
        writer.writeheader()
        for step, loss in enumerate(losses):
            writer.writerow({"epoch": 0, "step": step, "train/loss": loss})
    if evals:
        logger = EvalLogger(root / "evals")
        for step, reward in evals.items():
            logger.log(step, {"eval/reverse_text/reward": reward})
    return root


def test_several_runs_are_overlaid_each_where_it_has_the_metric(tmp_path, capsys):
    a = write_run(tmp_path / "bench" / "opd", [3.0, 2.0, 1.5], {0: 0.4, 2: 0.6})
    b = write_run(tmp_path / "bench" / "grpo", [1.0, 0.9])
    assert collect(a)["eval/reverse_text/reward"] == {0: 0.4, 2: 0.6}
    main([str(a), str(b)])
    out = tmp_path / "bench" / "report.png"  # beside the runs
    assert out.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "train/loss" in printed and "eval/reverse_text/reward: only in opd" in printed
    drawn = plot({"opd": collect(a), "grpo": collect(b)}, ["train/loss", "eval/reverse_text/reward"],
                 tmp_path / "x.png", "t")
    assert drawn == {"train/loss": ["opd", "grpo"], "eval/reverse_text/reward": ["opd"]}


def test_a_metric_in_no_run_and_an_empty_run_are_errors(tmp_path):
    a = write_run(tmp_path / "a", [1.0])
    with pytest.raises(SystemExit, match="no such metric"):
        main([str(a), "--metrics", "train/reward"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no metrics.csv"):
        main([str(a), str(tmp_path / "empty")])


def test_labels_are_directory_names_unless_they_clash(tmp_path):
    assert run_labels([tmp_path / "x" / "opd", tmp_path / "y" / "grpo"]) == ["opd", "grpo"]
    assert run_labels([tmp_path / "x" / "run", tmp_path / "y" / "run"]) == [str(tmp_path / "x" / "run"),
                                                                            str(tmp_path / "y" / "run")]
