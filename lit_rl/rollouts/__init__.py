"""Environments (tasks + rewards), shared by online evals and GRPO rollouts, and the pieces
a rollout is assembled from (`RolloutContext`, `TrainSampling`, `Transcript`). `DatasetEnv` is
a dataset plus reward functions named in the config; `ReasoningGymEnv` a reasoning-gym generator; `VerifiersEnv` a verifiers environment."""

from lit_rl.rollouts.context import RolloutContext, TrainSampling
from lit_rl.rollouts.dataset_env import DatasetEnv
from lit_rl.rollouts.envs import ArithmeticEnv, Environment, PromptsEnv, ReverseTextEnv, lcs_ratio
from lit_rl.rollouts.reasoning_gym_env import ReasoningGymEnv
from lit_rl.rollouts.turns import Transcript, completion_sample, completion_text
from lit_rl.rollouts.verifiers_env import VerifiersEnv

__all__ = [
    "ArithmeticEnv", "DatasetEnv", "Environment", "PromptsEnv", "ReasoningGymEnv", "ReverseTextEnv", "RolloutContext", "TrainSampling", "Transcript", "VerifiersEnv",
    "completion_sample", "completion_text", "lcs_ratio",
]
