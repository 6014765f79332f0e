"""Callbacks: checkpoint export (and later weight sync and online evals)."""

from lit_rl.callbacks.checkpoint import RunCheckpoint
from lit_rl.callbacks.export import HFExport

__all__ = ["HFExport", "RunCheckpoint"]
