"""Environments (tasks + rewards), shared by online evals and GRPO rollouts, and the pieces
a rollout is assembled from (`RolloutContext`, `TrainSampling`, `Transcript`)."""

from lit_rl.rollouts.context import RolloutContext, TrainSampling
from lit_rl.rollouts.envs import ArithmeticEnv, Environment, PromptsEnv, ReverseTextEnv, lcs_ratio
from lit_rl.rollouts.turns import Transcript, completion_sample, completion_text

__all__ = [
    "ArithmeticEnv", "Environment", "PromptsEnv", "ReverseTextEnv", "RolloutContext", "TrainSampling", "Transcript",
    "completion_sample", "completion_text", "lcs_ratio",
]
