"""`lit-rl --help` lists every command; each command's `--help` shows its options and what they do."""

from __future__ import annotations

import sys

import pytest

from lit_rl.cli import COMMANDS, main


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    """In-process calls see sys.argv as `lit-rl` would, without pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lit-rl"])


def help_of(args, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    assert e.value.code == 0, out.err[-2000:]
    return out.out


def test_top_level_help_lists_every_command_with_an_example(capsys):
    # lit-rl's own entry point (`main`, what the `lit-rl` script calls; the script itself runs in
    # test_docs_commands), not LightningCLI's fit/validate-only help
    text = help_of(["--help"], capsys)
    for name, command in COMMANDS.items():
        assert f"  {name}  " in text, name
        assert command.summary in text and f"e.g. {command.example}" in text, name
    assert {"fit", "validate", "data", "serve", "evaluate", "report"} <= set(COMMANDS)
    assert "Lightning Trainer command line tool" not in text


def test_no_command_prints_the_help_and_fails(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and "data preview" in capsys.readouterr().err


HELP_CASES = [
    (["fit", "--help"], ["--trainer.max_steps", "Stop training after this number of steps", "--ckpt_path", "--model.help"]),
    (["fit", "--model.help", "lit_rl.modules.SFT"], ["--model.model MODEL", "or a built-in model",
                                                     "--model.lr_scheduler LR_SCHEDULER"]),
    (["validate", "--help"], ["--ckpt_path", "--trainer.limit_val_batches"]),
    (["data", "--help"], ["preview", "show rows as they will be trained"]),
    (["data", "preview", "--help"], ["--rows", "how many rows to show", "dotted override"]),
    (["serve", "--help"], ["--model", "model directory", "--port"]),
    (["evaluate", "--help"], ["--weights-dir", "a run's weights/ directory", "--base-url"]),
    (["report", "--help"], ["--metrics", "metrics to plot", "run_dir"]),
]


@pytest.mark.parametrize("args, expected", HELP_CASES, ids=[" ".join(a) for a, _ in HELP_CASES])
def test_each_command_help_shows_its_options(args, expected, capsys):
    text = " ".join(help_of(args, capsys).split())
    for phrase in expected:
        assert phrase in text, (phrase, text[-3000:])
