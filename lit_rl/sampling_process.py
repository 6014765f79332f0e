"""The distribution a vLLM server drew a token from: the logits over the temperature, then top-k, then top-p.

Why the trainer needs it: the behaviour weight exp(trainer - sampler logprob), `mismatch_kl`
and the policy gradient all assume that the trainer's log-probability and the sampler's are
of one distribution, the one the token was drawn from. vLLM returns, by default, the
model's raw T=1 log-probabilities (`logprobs_mode: raw_logprobs`), before temperature, top-k
and top-p; the servers lit-rl starts ask for `processed_logprobs` instead, and the trainer
applies the same processing to its own logits (`SamplingProcess.apply`), so both sides see
the sampled distribution at any setting. At temperature 1 without top-k or top-p the two
modes agree and nothing is applied.

The processing mirrors vLLM's sampler (vllm/v1/sample/sampler.py and
ops/topk_topp_sampler.py, checked on 0.32): logits / temperature; top-k keeps the tokens
whose logit is at least the k-th largest (ties kept); top-p sorts ascending and drops the
tokens whose cumulative probability is at most 1 - p, always keeping the most likely; the
kept logits are renormalised (-inf elsewhere). The token that was sampled is always kept on
the trainer's side too: with weights a sync apart, or float differences at the boundary, the
trainer's kept set may miss it by a hair, and a -inf log-probability would poison the step.
The kept set is a constant of each step (no gradient flows through which tokens are kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: a log-probability for dropped tokens that keeps p * log p at 0 (exp of it is 0 in float32)
_DROPPED_LOGP = -1e30


@dataclass(frozen=True)
class SamplingProcess:
    """What the sampler did to the logits; vLLM's request fields of the same names."""

    temperature: float = 1.0
    top_k: int | None = None  # None, 0 or -1: off (vLLM's -1; the OpenAI API has no top_k)
    top_p: float = 1.0

    def __post_init__(self):
        problems = []
        if not self.temperature > 0:
            problems.append(f"temperature must be > 0 for training samples, got {self.temperature}")
        if self.top_k is not None and self.top_k < -1:
            problems.append(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def uses_top_k(self) -> bool:
        return self.top_k is not None and self.top_k > 0

    @property
    def is_identity(self) -> bool:
        """True when the sampled distribution is the model's own (T = 1, no top-k, no top-p)."""
        return self.temperature == 1.0 and not self.uses_top_k and self.top_p >= 1.0

    def kept(self, scaled_logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor | None:
        """Which tokens top-k and top-p keep, [..., V] bool (None: all), from logits already over the
        temperature; the `targets` [...] (the sampled tokens) are always kept."""
        if not self.uses_top_k and self.top_p >= 1.0:
            return None
        with torch.no_grad():
            logits = scaled_logits.float()
            keep = torch.ones_like(logits, dtype=torch.bool)
            if self.uses_top_k and self.top_k < logits.shape[-1]:
                kth = logits.topk(self.top_k, dim=-1).values[..., -1:]  # [..., 1]
                keep &= logits >= kth
            if self.top_p < 1.0:
                ordered, order = logits.masked_fill(~keep, float("-inf")).sort(dim=-1)  # ascending
                cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)  # [..., V]
                dropped = cumulative <= 1.0 - self.top_p
                dropped[..., -1] = False  # the most likely token always stays
                keep &= ~torch.zeros_like(dropped).scatter(-1, order, dropped)
            if targets is not None:
                keep.scatter_(-1, targets.unsqueeze(-1), True)
            return keep

    def apply(self, logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The processed logits [..., V] float32: over the temperature, a very negative number where
        top-k or top-p drop a token (so that p log p stays 0); differentiable where kept."""
        logits = logits.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        keep = self.kept(logits, targets)
        return logits if keep is None else logits.masked_fill(~keep, _DROPPED_LOGP)


#: the model's own distribution: what a trainer without sampling settings compares with
RAW = SamplingProcess()
