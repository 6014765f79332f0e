"""Learning-rate schedules usable by class_path from a config (`model.init_args.lr_scheduler`)."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosineLR(LambdaLR):
    """Linear warm-up for `warmup_steps`, then cosine decay to `min_lr_ratio` x the peak at `total_steps`.

    Stepped once per optimizer step (lit-rl modules step it themselves).
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0, total_steps: int = 1000, min_lr_ratio: float = 0.0):
        if total_steps <= 0 or warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(
                f"WarmupCosineLR: need total_steps > 0, warmup_steps >= 0, 0 <= min_lr_ratio <= 1; got "
                f"total_steps={total_steps}, warmup_steps={warmup_steps}, min_lr_ratio={min_lr_ratio}"
            )
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio
        super().__init__(optimizer, self._factor)

    def _factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
