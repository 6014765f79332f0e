"""SFT: next-token cross-entropy on the trained (assistant) tokens only.

The per-token loss is summed here and divided by the trained tokens of the whole
optimizer step in `CausalLMModule.training_step`: every trained token weighs the
same, whatever row, micro-batch or rank it lands in (unlike a mean per sequence).
The output head runs only at trained positions, in chunks (`CausalLMModule`).
"""

from __future__ import annotations

import torch

from lit_rl.modules.base import CausalLMModule


class SFT(CausalLMModule):
    loss_kind = "cross_entropy"

    def micro_batch_loss_sum(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.target_cross_entropy_sum(micro_batch)
