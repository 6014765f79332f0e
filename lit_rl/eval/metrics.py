"""Eval metrics on torchmetrics: mean reward, and pass@k when several samples per prompt.

pass@k uses the unbiased estimator of Chen et al. (2021): with n samples of which c
pass, pass@k = 1 - C(n-c, k) / C(n, k), averaged over tasks. A sample passes when its
reward reaches `threshold` (1.0: a perfect answer).
"""

from __future__ import annotations

from math import comb

import torch
from torchmetrics import MeanMetric, Metric


def pass_at_k(n: int, c: int, k: int) -> float:
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


class PassAtK(Metric):
    full_state_update = False

    def __init__(self, k: int, threshold: float = 1.0):
        super().__init__()
        self.k, self.threshold = k, threshold
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tasks", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, rewards: list[float]) -> None:
        """The rewards of all samples of one task."""
        passed = sum(r >= self.threshold for r in rewards)
        self.total += pass_at_k(len(rewards), passed, self.k)
        self.tasks += 1

    def compute(self) -> torch.Tensor:
        return self.total / self.tasks.clamp(min=1)


def task_metrics(samples_per_prompt: int) -> dict[str, Metric]:
    """The metrics an environment gets: mean reward, and pass@1 / pass@k for k up to the samples."""
    metrics: dict[str, Metric] = {"reward": MeanMetric()}
    if samples_per_prompt > 1:
        for k in sorted({1, samples_per_prompt}):
            metrics[f"pass@{k}"] = PassAtK(k)
    return metrics
