"""Callbacks: checkpoint export, weight sync to the rollout server, online evals, progress."""

from lit_rl.callbacks.checkpoint import RunCheckpoint
from lit_rl.callbacks.export import HFExport
from lit_rl.callbacks.online_eval import OnlineEval
from lit_rl.callbacks.progress import StepProgressBar
from lit_rl.callbacks.weight_sync import WeightSync

__all__ = ["HFExport", "OnlineEval", "RunCheckpoint", "StepProgressBar", "WeightSync"]
