"""StepProgressBar: training progress in optimizer steps of the whole run, `lit-rl fit`'s default bar.

    train  49%|█████     | 148/300 [01:02<01:04, 2.36step/s, loss=0.4123, tok/s=2310]

Lightning's own bar counts batches of the current epoch (`Epoch 0/-2`), shows `v_num`, and
after a resume counts the remaining batches as if they were the whole run (`300/151`). lit-rl
runs are sized in optimizer steps (`trainer.max_steps`; one lit-rl batch is one step), so this
bar counts `trainer.global_step` out of the run's total steps. After a resume it starts at the
restored step: the time shown is this launch's, and the rate and the remaining time come from
the steps taken in this launch only.

It shows the metrics that say how the run is going, when the module logs them: the loss and
trained tokens/s (SFT), the reward, reverse KL or divergence (OPD), staleness and rollout throughput (RL), the validation loss,
and whatever the module logs with `prog_bar=True`. Validation bars are Lightning's.
"""

from __future__ import annotations

import math
import sys

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n
from tqdm import tqdm

# logged name -> (label on the bar, format)
SHOWN = {
    "train/loss": ("loss", "{:.4g}"),
    "train/tokens_per_s": ("tok/s", "{:.0f}"),
    "train/reward": ("reward", "{:.3f}"),
    "train/reverse_kl": ("reverse kl", "{:.3f}"),
    "train/divergence": ("divergence", "{:.3f}"),
    "train/staleness_mean": ("staleness", "{:.2f}"),
    "rollout/tokens_per_s": ("rollout tok/s", "{:.0f}"),
    "val/loss": ("val loss", "{:.4g}"),
}


def total_steps(trainer) -> int | None:
    """The run's optimizer steps: `max_steps`, or what `max_epochs` amounts to; None when endless."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    steps = trainer.estimated_stepping_batches
    return int(steps) if math.isfinite(steps) else None


class StepProgressBar(TQDMProgressBar):
    """A training bar in optimizer steps of the whole run (resumed steps included), no `v_num`."""

    BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def init_train_tqdm(self) -> tqdm:
        # plain tqdm: Lightning's Tqdm pads numbers with zeros ("tok/s=1234.")
        return tqdm(desc="train", position=2 * self.process_position, disable=self.is_disabled, leave=True,
                    dynamic_ncols=True, smoothing=0, unit="step", file=sys.stdout, bar_format=self.BAR_FORMAT)

    def on_train_start(self, trainer, pl_module) -> None:
        self.train_progress_bar = bar = self.init_train_tqdm()
        bar.reset(total=total_steps(trainer))  # starts this launch's clock
        bar.initial = bar.n = bar.last_print_n = trainer.global_step  # resumed steps count, but not toward the rate
        bar.refresh()

    def on_train_epoch_start(self, trainer, *_) -> None:
        pass  # one bar for the whole run, not one per epoch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if self._should_update(trainer.global_step, bar.total):
            _update_n(bar, trainer.global_step)
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=True)

    def get_metrics(self, trainer, pl_module) -> dict[str, str]:
        logged = trainer.callback_metrics
        items = {}
        for name, (label, fmt) in SHOWN.items():
            if name in logged:
                items[label] = fmt.format(float(logged[name]))
        for name, value in trainer.progress_bar_metrics.items():  # the module's prog_bar=True choices
            items.setdefault(name, f"{value:.4g}" if isinstance(value, float) else str(value))
        return items
