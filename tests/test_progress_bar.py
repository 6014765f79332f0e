"""StepProgressBar's text, rendered as a terminal shows it, for a fresh and for a resumed run.

The bar is driven through the hooks Lightning calls, with a stand-in trainer that holds
only what the bar reads (global step, run length, logged metrics), so each case is exact
and fast; tests/test_cli.py checks the bar in a real `lit-rl fit`.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import torch

from lit_rl.callbacks import StepProgressBar


def fake_trainer(step: int, max_steps: int = 300, metrics: dict | None = None):
    return SimpleNamespace(
        global_step=step,
        max_steps=max_steps,
        estimated_stepping_batches=max_steps,
        callback_metrics={k: torch.tensor(v) for k, v in (metrics or {}).items()},
        progress_bar_metrics={"loss": 0.5},  # what base.py logs with prog_bar=True
        sanity_checking=False,
    )


def run_steps(bar: StepProgressBar, trainer, steps: int, seconds_per_step: float = 0.0) -> str:
    bar.on_train_start(trainer, None)
    bar.on_train_epoch_start(trainer, None)
    for i in range(steps):
        time.sleep(seconds_per_step)
        trainer.global_step += 1
        bar.on_train_batch_end(trainer, None, None, None, i)
    return str(bar.train_progress_bar)


SFT = {"train/loss": 1.23456, "train/tokens_per_s": 2310.4}


def test_fresh_run_counts_optimizer_steps_and_shows_sft_metrics():
    text = run_steps(StepProgressBar(), fake_trainer(0, metrics=SFT), steps=3)
    assert " 3/300 " in text, text
    assert re.search(r"\[\d\d:\d\d<", text), text  # elapsed < remaining
    assert "loss=1.235" in text and "tok/s=2310" in text, text
    assert "v_num" not in text and "Epoch" not in text and "-2" not in text, text


def test_resumed_run_counts_restored_steps_and_this_launchs_time():
    # resumed at step 148 of 300: the bar starts at 148, and the rate (so the remaining time)
    # comes from this launch's 2 steps only, not 150 steps in 0.2 seconds
    bar = StepProgressBar()
    text = run_steps(bar, fake_trainer(148, metrics=SFT), steps=2, seconds_per_step=0.1)
    assert " 150/300 " in text, text
    assert "300/151" not in text
    assert bar.train_progress_bar.initial == 148
    elapsed, remaining = re.search(r"\[(\d\d:\d\d)<(\d\d:\d\d)", text).groups()
    assert elapsed == "00:00", text  # this launch's time, not the whole run's
    rate = float(re.search(r"([\d.]+)step/s", text).group(1))
    assert 2 < rate < 15, text  # about 10 steps/s: 2 steps in 0.2 s; 150 steps would read 750
    minutes, seconds = map(int, remaining.split(":"))
    assert 5 <= 60 * minutes + seconds <= 80, text  # 150 steps left at about 10 steps/s


def test_rl_metrics_are_shown_when_logged():
    rl = {"train/loss": 0.1, "train/reward": 0.625, "train/staleness_mean": 1.5, "rollout/tokens_per_s": 812.0}
    text = run_steps(StepProgressBar(), fake_trainer(0, max_steps=10, metrics=rl), steps=1)
    assert "reward=0.625" in text and "staleness=1.50" in text and "rollout tok/s=812" in text, text
    assert "tok/s=812" in text and "tok/s=2310" not in text


def test_epoch_sized_run_takes_its_total_from_the_epochs():
    trainer = fake_trainer(0, max_steps=-1)
    trainer.estimated_stepping_batches = 40
    assert " 1/40 " in run_steps(StepProgressBar(), trainer, steps=1)
