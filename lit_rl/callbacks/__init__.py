"""Callbacks: checkpoint export (and later weight sync and online evals)."""

from lit_rl.callbacks.checkpoint import RunCheckpoint
from lit_rl.callbacks.export import HFExport
from lit_rl.callbacks.online_eval import OnlineEval

__all__ = ["HFExport", "OnlineEval", "RunCheckpoint"]
