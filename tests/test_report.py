"""`lit-rl report` over real CSV logs: one run, and several runs overlaid on shared panels."""

import csv

import pytest
import yaml

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


def write_validate_launch(root, version, ckpt_path, val_loss):
    """A `lit-rl validate` launch as Lightning logs it: its saved config, val/loss at step 0."""
    log_dir = root / "logs" / f"version_{version}"
    log_dir.mkdir(parents=True)
    (log_dir / "config.yaml").write_text(yaml.safe_dump({"ckpt_path": ckpt_path, "trainer": {}}))
    (log_dir / "metrics.csv").write_text(f"epoch,step,val/loss\n0,0,{val_loss}\n")


def test_a_validate_launch_is_drawn_at_its_checkpoints_step_or_left_out(tmp_path):
    """Lightning logs `lit-rl validate` at step 0, which drew the final checkpoint's loss at the start
    of the curve. At the checkpoint's step when it is known (here from Lightning's checkpoint name;
    tests/test_resume.py reads a real last.ckpt), where the fit logs the step that made those weights;
    left out when it is not (a checkpoint that is gone)."""
    run = write_run(tmp_path / "run", [3.0, 2.0, 1.5, 1.0])
    write_validate_launch(run, 1, str(tmp_path / "gone.ckpt"), 0.9)
    assert "val/loss" not in collect(run)
    write_validate_launch(run, 2, str(run / "checkpoints" / "epoch=0-step=4.ckpt"), 0.8)
    write_validate_launch(run, 3, None, 3.5)  # no checkpoint: the config's model, untrained
    assert collect(run)["val/loss"] == {3: 0.8, 0: 3.5}


def test_other_folders_under_logs_are_ignored_and_out_goes_where_asked(tmp_path, capsys):
    """A user's `logs/version_0_old` crashed `int()`; an --out in a directory that does not exist yet
    was a FileNotFoundError traceback."""
    run = write_run(tmp_path / "run", [3.0, 2.0])
    (run / "logs" / "version_0_old").mkdir()
    (run / "logs" / "version_0_old" / "metrics.csv").write_text("epoch,step,train/loss\n0,0,99.0\n")
    assert collect(run)["train/loss"] == {0: 3.0, 1: 2.0}
    out = tmp_path / "plots" / "today" / "curves.png"
    main([str(run), "--out", str(out)])
    assert out.stat().st_size > 10_000 and f"wrote {out}" in capsys.readouterr().out
    # without a suffix: a PNG, and the path printed is the file written (it said `curves`, wrote curves.png)
    main([str(run), "--out", str(tmp_path / "curves")])
    assert (tmp_path / "curves.png").is_file() and f"wrote {tmp_path / 'curves.png'} " in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--out .*o\.xyz: matplotlib cannot write '\.xyz' files; give one of .*\.png"):
        main([str(run), "--out", str(tmp_path / "o.xyz")])  # a traceback from inside matplotlib


@pytest.mark.parametrize("cut", ["0,3,1e-", "0,3,0.1"])  # of "0,3,1e-05", "0,3,0.125"
def test_a_last_row_cut_short_is_left_out(tmp_path, cut):
    """A full disk or a crash while the logger appended a row leaves it without its line end: the
    report failed on it (ValueError: could not convert string to float: '1e-'), or drew the number
    cut short."""
    run = write_run(tmp_path / "run", [3.0, 2.0, 1.5], evals={0: 0.25, 2: 0.5})
    with open(run / "logs" / "version_0" / "metrics.csv", "a") as f:
        f.write(cut)
    with open(run / "evals" / "eval_metrics.csv", "a") as f:  # the evaluator's log, cut the same way
        f.write(cut.replace("0,3,", "3,eval/reverse_text/reward,"))
    assert collect(run)["train/loss"] == {0: 3.0, 1: 2.0, 2: 1.5}
    assert collect(run)["eval/reverse_text/reward"] == {0: 0.25, 2: 0.5}
    main([str(run)])
    assert (run / "report.png").stat().st_size > 10_000
