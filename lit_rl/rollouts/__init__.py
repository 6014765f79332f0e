"""Environments (tasks + rewards), shared by online evals and GRPO rollouts."""

from lit_rl.rollouts.envs import Environment, ReverseTextEnv, lcs_ratio

__all__ = ["Environment", "ReverseTextEnv", "lcs_ratio"]
