"""Callbacks: checkpoint export, resumable checkpoints, online evals, progress. (The inference
servers and the weight sync to them belong to `lit_rl.inference.InferenceRuntime`.)"""

from lit_rl.callbacks.checkpoint import RunCheckpoint
from lit_rl.callbacks.export import HFExport
from lit_rl.callbacks.online_eval import OnlineEval
from lit_rl.callbacks.progress import StepProgressBar

__all__ = ["HFExport", "OnlineEval", "RunCheckpoint", "StepProgressBar"]
