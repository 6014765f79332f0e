"""LightningModules: one readable file per algorithm on top of a shared causal-LM base."""

from lit_rl.modules.base import CausalLMModule
from lit_rl.modules.grpo import GRPO
from lit_rl.modules.opd import OPD
from lit_rl.modules.sft import SFT

__all__ = ["CausalLMModule", "GRPO", "OPD", "SFT"]
