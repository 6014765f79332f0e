"""The `lit-rl` entry point. Runs that train or validate run `python -m lit_rl.cli` in a process of
their own, forked from one that has imported lit-rl already (`run`, tests/forked_cli.py: a fresh
interpreter's 6-9 s of imports once per pytest worker, not once per run); commands that only parse,
print or reject a config call `lit_rl.cli.main` in this process (`lit_rl_main`, tests/conftest.py).
The installed console script and the documented commands run as fresh processes
(tests/test_install.py, tests/test_docs_commands.py)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from forked_cli import run_forked
from helpers import REPO, reverse_rows, write_jsonl
from test_docs_yaml import server_problems_in

CONFIG = str(REPO / "examples" / "reverse_text" / "sft.yaml")


def run(args, env=None, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return run_forked(args, env, str(REPO), timeout)


def fit_args(tmp_path, data, steps=3):
    return [
        "fit", "--config", CONFIG,
        "--data.init_args.path", data,
        "--data.init_args.num_workers", "0",
        "--data.init_args.batch_size", "8",
        "--data.init_args.val_path", "",  # the example's held-out file is written by the demo, not here
        "--trainer.default_root_dir", str(tmp_path / "run"),
        "--trainer.max_steps", str(steps),
    ]


def metrics_rows(root: Path):
    (path,) = sorted(root.glob("logs/version_*/metrics.csv"))[-1:]
    return list(csv.DictReader(open(path)))


@pytest.mark.slow
def test_fit_runs_end_to_end_and_reruns_into_same_dir(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(40))
    args = fit_args(tmp_path, data) + ["--trainer.log_every_n_steps", "1", "--model.init_args.lr_scheduler.init_args.warmup_steps", "1"]
    first = run(args)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [r for r in metrics_rows(tmp_path / "run") if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for name in ("train/loss", "train/tokens", "train/tokens_per_s", "train/lr", "train/grad_norm", "train/padding_fraction"):
        assert float(rows[-1][name]) >= 0.0, name
    # the schedule (cosine to 0.05 x lr after 1 warm-up step) lasts the 3 steps given on the command line only
    peak, floor = 0.003, 0.05
    expected = [0.0, peak, peak * (floor + (1 - floor) * 0.5)]
    assert [float(r["train/lr"]) for r in rows] == pytest.approx(expected)
    # the default progress bar counts optimizer steps of the run and shows the SFT metrics, no v_num
    assert " 3/3 [" in first.stdout and "tok/s=" in first.stdout and "loss=" in first.stdout, first.stdout[-2000:]
    assert "v_num" not in first.stdout and "Epoch" not in first.stdout
    # no warning from inside Lightning that the user cannot act on (no validation data is what was asked)
    for noise in ("You defined a `validation_step` but have no `val_dataloader`", "`isinstance(treespec, LeafSpec)`",
                  "Total length of `list` across ranks is zero"):
        assert noise not in first.stdout + first.stderr, noise
    assert (tmp_path / "run" / "weights" / "step_3" / "STABLE").is_file()
    # the saved config runs again, into another directory given on the command line: its logs go there, not
    # into the run it was saved from (the default logger is the trainer's, not written into the config);
    # a second run into the same directory not tripping over the saved config: tests/test_resume.py
    saved = tmp_path / "run" / "logs" / "version_0" / "config.yaml"
    assert yaml.safe_load(saved.read_text())["trainer"]["logger"] is None
    second = run(["fit", "--config", str(saved), "--trainer.default_root_dir", str(tmp_path / "again")])
    assert second.returncode == 0, second.stderr[-3000:]
    assert [p.name for p in (tmp_path / "run" / "logs").iterdir()] == ["version_0"]
    assert [int(r["step"]) for r in metrics_rows(tmp_path / "again") if r.get("train/loss")] == [0, 1, 2]


def test_with_a_wandb_logger_the_config_is_saved_in_the_run_not_over_the_users_own(tmp_path):
    """Lightning saves the config in the first logger's save_dir when that is not its CSV or
    TensorBoard logger; W&B's is the working directory by default, and its `config.yaml` (here the
    user's own, in save_dir) was replaced by the saved config."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    users = tmp_path / "project"
    users.mkdir()
    (users / "config.yaml").write_text("# my config, with my notes\n")
    logger = {"class_path": "lightning.pytorch.loggers.WandbLogger",
              "init_args": {"offline": True, "project": "lit-rl-test", "save_dir": str(users)}}
    out = run(fit_args(tmp_path, data, steps=1) + ["--trainer.logger", json.dumps(logger)], env={"WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (users / "config.yaml").read_text() == "# my config, with my notes\n"
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["trainer"]["max_steps"] == 1


def test_without_a_logger_the_config_saved_in_the_run_directory_never_replaces_the_users(tmp_path, lit_rl_main):
    """`trainer.logger: false` saved the config in `default_root_dir` (the working directory when
    unset), over the user's own `config.yaml` there. Now a `config.yaml` lit-rl did not save is kept
    (the launch's goes to `run_config.yaml`), and the one it saved is replaced by the next launch."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    users = tmp_path / "project"
    users.mkdir()
    (users / "config.yaml").write_text("# my config, with my notes\n")
    no_logger = ["--trainer.logger", "false", "--trainer.max_steps", "1"]
    code, _, stderr = lit_rl_main(fit_args(tmp_path, data) + ["--trainer.default_root_dir", str(users), *no_logger])
    assert code == 0, stderr[-3000:]
    assert (users / "config.yaml").read_text() == "# my config, with my notes\n"
    assert yaml.safe_load((users / "run_config.yaml").read_text())["trainer"]["max_steps"] == 1
    for steps in ("1", "2"):  # into a directory of its own: config.yaml, replaced by the next launch
        code, _, stderr = lit_rl_main(fit_args(tmp_path, data) + [*no_logger, "--trainer.max_steps", steps])
        assert code == 0, stderr[-3000:]
        assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["trainer"]["max_steps"] == int(steps)
    assert not (tmp_path / "run" / "run_config.yaml").exists()


def test_validate_reports_val_loss(tmp_path, lit_rl_main):
    data = write_jsonl(tmp_path / "val.jsonl", reverse_rows(12))
    code, stdout, stderr = lit_rl_main(["validate", "--config", CONFIG, "--data.init_args.path", data, "--data.init_args.val_path",
                                        data, "--data.init_args.num_workers", "0", "--trainer.default_root_dir", str(tmp_path / "run")])
    assert code == 0, stderr[-3000:]
    assert "val/loss" in stdout
    code, _, stderr = lit_rl_main(["validate", "--config", CONFIG, "--data.init_args.path", data, "--data.init_args.val_path", "",
                                   "--data.init_args.num_workers", "0", "--trainer.default_root_dir", str(tmp_path / "run")])
    assert code != 0 and "val_path" in stderr


def test_print_config_shows_overrides_and_env(lit_rl_main, monkeypatch):
    monkeypatch.setenv("LIT_RL_FIT__TRAINER__MAX_EPOCHS", "7")  # env fills fields the config leaves at defaults
    code, stdout, stderr = lit_rl_main(["fit", "--config", CONFIG, "--data.init_args.batch_size", "8", "--print_config"])
    assert code == 0, stderr[-2000:]
    config = yaml.safe_load(stdout)
    assert config["data"]["init_args"]["batch_size"] == 8
    assert config["trainer"]["max_epochs"] == 7
    assert config["model"]["class_path"] == "lit_rl.modules.SFT"
    assert config["model"]["init_args"]["trust_remote_code"] is False


def test_bad_flag_is_reported(lit_rl_main):
    code, _, stderr = lit_rl_main(["fit", "--config", CONFIG, "--data.init_args.no_such_field", "1"])
    assert code != 0
    assert "no_such_field" in stderr


def test_data_preview_text_and_json(tmp_path, lit_rl_main):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(6))
    code, stdout, stderr = lit_rl_main(["data", "preview", "--config", CONFIG, "--rows", "2", "--data.init_args.path", data])
    assert code == 0, stderr[-2000:]
    first = reverse_rows(1)[0]["messages"][1]["content"]
    assert f"[[{first}<|im_end|>]]" in stdout
    _, stdout, _ = lit_rl_main(["data", "preview", "--config", CONFIG, "--rows", "3", "--json", "--data.init_args.path", data])
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [line["row"] for line in lines] == [0, 1, 2]
    assert all(len(line["input_ids"]) == len(line["loss_mask"]) and any(line["loss_mask"]) for line in lines)
    # a start past either end is refused, naming the rows there are (it printed row -1 as the last one, or nothing)
    for start in ("-1", "6"):
        code, stdout, stderr = lit_rl_main(["data", "preview", "--config", CONFIG, "--start", start, "--data.init_args.path", data])
        assert code == 1 and not stdout and "Traceback" not in stderr, stderr[-2000:]
        assert f"--start {start} is not a row of the training data: it has 6 rows (--start 0 to 5)" in stderr


def test_data_preview_reads_its_config_arguments_as_fit_does(tmp_path, lit_rl_main):
    """Two --config files (a strategy's, say) merged in order, a negative value after a dotted flag and a
    top-level key: preview kept the last config only (a usage error), and took `-5` and
    `--seed_everything` for unknown flags."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(4))
    second = tmp_path / "data.yaml"
    second.write_text(f"data:\n  init_args:\n    path: {data}\n    max_length: 64\n")
    code, stdout, stderr = lit_rl_main(["data", "preview", "--config", CONFIG, "--config", str(second), "--rows", "1",
                                        "--seed_everything", "3"])
    assert code == 0 and f"[[{reverse_rows(1)[0]['messages'][1]['content']}<|im_end|>]]" in stdout, stderr[-2000:]
    code, _, stderr = lit_rl_main(["data", "preview", "--config", CONFIG, "--config", str(second),
                                   "--data.init_args.max_length", "-5"])
    assert code == 1 and "data.max_length must be >= 2 tokens, got -5" in stderr, stderr[-2000:]


@pytest.mark.parametrize("group_size", ["8", "1"])
def test_data_preview_of_an_rl_config_says_it_needs_a_dataset(tmp_path, lit_rl_main, group_size):
    """An RL config's rows are generated while it trains: one message naming its data class, not a
    batch-size problem of the preview's own making (group_size 8) or an AttributeError (group_size 1)."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(6))
    code, _, stderr = lit_rl_main(["data", "preview", "--config", str(REPO / "examples" / "reverse_text" / "grpo.yaml"),
                                   "--model.init_args.model", "lit-rl:tiny_qwen3", "--data.init_args.env.init_args.path", data,
                                   "--data.init_args.group_size", group_size])
    assert code == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert "preview shows the rows of a lit_rl.data.datamodules.StaticDataModule" in stderr
    assert "this config's data is lit_rl.data.rollout_datamodule.RolloutDataModule" in stderr


def test_values_refused_only_when_the_run_starts_name_their_flag(tmp_path, lit_rl_main):
    """torch's refusal of the optimizer's lr (when the trainer builds it) and Lightning's of a seed
    outside numpy's range were tracebacks; each is one message naming the flag, and no logs are left."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    for flag, value, said in (("--model.init_args.optimizer.init_args.lr", "-1",
                               "invalid config: model.init_args.optimizer: Invalid learning rate: -1"),
                              ("--seed_everything", "-5", "invalid config: seed_everything (-5) must be in [0, 4294967295]")):
        code, _, stderr = lit_rl_main(fit_args(tmp_path, data) + [flag, value])
        assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
        assert said in stderr, stderr[-3000:]
        assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.parametrize("config", sorted(str(p) for p in [*REPO.glob("configs/*.yaml"), *REPO.glob("examples/*/*.yaml")]))
def test_shipped_configs_parse(config, lit_rl_main):
    code, stdout, stderr = lit_rl_main(["fit", "--config", config, "--print_config"])
    assert code == 0, stderr[-2000:]
    parsed = yaml.safe_load(stdout)
    assert parsed["model"]["class_path"].startswith("lit_rl.") and parsed["data"]["class_path"].startswith("lit_rl.")
    assert not server_problems_in(parsed)  # free-form to the parser: checked as a run checks them before a start


def test_a_forked_run_sees_what_python_dash_m_gives_it(tmp_path):
    """`run` forks lit-rl from a process that has imported it (tests/forked_cli.py), to spare each
    run a fresh interpreter's imports. The fork must not see more than `python -m lit_rl.cli`
    would: a callback from tests/ is not importable without PYTHONPATH, although the pytest worker
    that forks it has tests/ on its path; with PYTHONPATH it is. Same exit codes and last lines as
    a fresh interpreter, both ways (2: the config is invalid)."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    args = fit_args(tmp_path, data) + ["--trainer.callbacks+=online_eval_helpers.CrashAtStep", "--print_config"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    for extra in ({}, {"PYTHONPATH": str(REPO / "tests")}):
        forked = run_forked(args, {**env, **extra}, str(REPO), timeout=300)
        fresh = subprocess.run([sys.executable, "-m", "lit_rl.cli", *args], cwd=REPO, env={**env, **extra},
                               capture_output=True, text=True, timeout=300)
        assert forked.returncode == fresh.returncode == (0 if extra else 2), (forked.stderr[-2000:], fresh.stderr[-2000:])
        assert forked.stdout == fresh.stdout
        assert forked.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:], forked.stderr[-2000:]
    assert "online_eval_helpers.CrashAtStep" in forked.stdout  # the config printed names the callback
