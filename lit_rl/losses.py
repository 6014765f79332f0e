"""Pure loss functions. Every tensor line carries its shape.

B: rows in the micro-batch, T: tokens per row, V: vocabulary size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shifted_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token given the ones before it; position 0 gets 0.

    Returns [B, T] aligned with `input_ids` so that masks and inference logprobs, which
    are indexed by token, line up without further shifting.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    taken = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    return F.pad(taken, (1, 0))  # [B, T]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the distribution each token was predicted from, aligned like
    `shifted_token_logprobs` (position t gets the entropy of logits[t-1]; position 0 gets 0)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    return F.pad(-(logp.exp() * logp).sum(-1), (1, 0))  # [B, T]


def masked_cross_entropy_sum(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the target tokens (loss_mask True).

    A sum, not a mean: the caller divides by the trained tokens of the whole optimizer
    step, which makes loss and gradient independent of how the step is split.
    """
    targets = loss_mask[:, 1:]  # [B, T-1]
    picked_logits = logits[:, :-1][targets].float()  # [N, V], N = target tokens
    picked_ids = input_ids[:, 1:][targets]  # [N]
    return F.cross_entropy(picked_logits, picked_ids, reduction="sum")  # []
