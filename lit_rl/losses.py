"""Pure loss functions. Every tensor line carries its shape.

B: rows in the micro-batch, T: tokens per row, V: vocabulary size.

Two forms of each RL loss, on purpose: `policy_loss` and `opd_loss` are the reference
definitions, a whole batch as [B, T] in one call, written to be read and checked by hand; the
modules train with `policy_loss_sums` and `opd_loss_sums`, the numerator of the same loss for any
micro-batch layout (packed rows, several sequences per row), which the training step divides by
the whole step's normaliser (lit_rl/modules/step.py). Tests hold the `*_sums` forms, and a real
optimizer step of the modules, to the reference on the same samples (tests/test_policy_loss.py,
tests/test_opd_loss.py, tests/test_grpo_step.py, tests/test_mixed_step.py).
"""

from __future__ import annotations

import math

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


# ---- the policy-gradient loss of GRPO and its relatives ------------------------------------------------
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")
IS_CORRECTIONS = ("token_truncate", "token_mask", "none")
POLICY_METRICS = ("mismatch_kl", "clip_fraction", "is_capped_fraction")


def check_behaviour_options(is_correction: str, is_cap: float) -> list[str]:
    """Every problem with the behaviour-policy correction's options (`behaviour_weight`)."""
    problems = []
    if is_correction not in IS_CORRECTIONS:
        problems.append(f"is_correction must be one of {IS_CORRECTIONS}, got {is_correction!r}")
    if not is_cap > 0:  # NaN too (a YAML .nan): every weight would be NaN; inf is no cap
        problems.append(f"is_cap must be > 0, got {is_cap}")
    return problems


def check_policy_loss_options(loss_type: str, is_correction: str, clip_low: float, clip_high: float, is_cap: float,
                              max_completion_length: int | None) -> list[str]:
    """Every problem with a combination of policy-loss options, for one error at start-up."""
    problems = []
    if loss_type not in LOSS_TYPES:
        problems.append(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not 0 <= clip_low < 1 or not clip_high >= 0:  # NaN refused; inf: no upper clip
        problems.append(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    problems += check_behaviour_options(is_correction, is_cap)
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length < 1):
        problems.append(f"loss_type 'dr_grpo' needs max_completion_length >= 1, got {max_completion_length}")
    return problems


def behaviour_weight(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, is_correction: str,
                     is_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour-policy correction of each token, detached: log w = old - inference (the
    trainer before the update against the sampler), and the weight the loss uses:
    token_truncate min(w, is_cap), token_mask w if w <= is_cap else 0, none 1. Any shape."""
    log_w = (old_logprobs - inference_logprobs).detach()
    w = torch.exp(log_w)
    if is_correction == "token_truncate":
        return log_w, w.clamp(max=is_cap)
    if is_correction == "token_mask":
        return log_w, torch.where(w <= is_cap, w, torch.zeros_like(w))
    if is_correction == "none":
        return log_w, torch.ones_like(w)
    raise ValueError(f"is_correction must be one of {IS_CORRECTIONS}, got {is_correction!r}")


def behaviour_metric_sums(log_w: torch.Tensor, is_cap: float) -> dict[str, torch.Tensor]:
    """Sums over tokens of how far the sampler is from the trainer: mismatch_kl, w - log w - 1
    of the uncapped w (exact for tiny gaps), and is_capped_fraction, tokens with w > is_cap."""
    with torch.no_grad():
        return {"mismatch_kl": (torch.expm1(log_w) - log_w).sum(), "is_capped_fraction": (log_w.exp() > is_cap).float().sum()}


def policy_loss_sums(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    sequence_ids: torch.Tensor,
    *,
    loss_type: str = "dapo",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_correction: str = "token_truncate",
    is_cap: float = 2.0,
    extra_token_loss: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The numerator of `policy_loss` and its metric sums, for tokens laid out in any shape.

    All tensors share one shape (e.g. a packed micro-batch [B, T]); `advantages` is per token
    and `sequence_ids` says which sequence each token belongs to (>= 0; packing puts -1 on
    padding, which loss_mask excludes). A sequence must lie wholly in the tensors given, so
    that per-sequence means are exact; then the sums of several calls (micro-batches, ranks)
    add up to the sums of one call over everything, and dividing by `policy_loss_normaliser`
    of everything gives `policy_loss`. `extra_token_loss` (e.g. a KL penalty per token) is
    added to each token's loss before aggregation. Returns (loss sum [], metric sums: each
    metric's sum over masked tokens, plus "tokens", the masked-token count).
    """
    mask = loss_mask.bool()
    lp, old, inf, adv = logprobs[mask], old_logprobs[mask], inference_logprobs[mask], advantages[mask]  # [N] each
    seq = sequence_ids[mask]  # [N]
    _, seq = torch.unique(seq, return_inverse=True)  # [N], sequences renumbered 0..S-1
    num_seqs = int(seq.max()) + 1 if seq.numel() else 0
    per_seq_tokens = torch.zeros(num_seqs, dtype=lp.dtype, device=lp.device).index_add_(0, seq, torch.ones_like(lp))  # [S]

    def seq_mean(values: torch.Tensor) -> torch.Tensor:  # [N] -> [N]: each token gets its sequence's mean
        sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seq, values)  # [S]
        return (sums / per_seq_tokens)[seq]  # [N]

    log_ratio = lp - old  # [N]
    if loss_type == "gspo":
        log_ratio = seq_mean(log_ratio)  # [N]: the sequence-level ratio, on every token of the sequence
    ratio = torch.exp(log_ratio)  # [N]
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N]
    objective = torch.minimum(ratio * adv, clipped_ratio * adv)  # [N]
    log_w, weight = behaviour_weight(old, inf, is_correction, is_cap)  # [N], [N]
    token_loss = -weight * objective  # [N]
    if extra_token_loss is not None:
        token_loss = token_loss + extra_token_loss[mask]  # [N]
    if loss_type in ("grpo", "gspo"):
        loss_sum = (token_loss / per_seq_tokens[seq]).sum()  # []: sum over sequences of each one's token mean
    elif loss_type in ("dapo", "dr_grpo"):
        loss_sum = token_loss.sum()  # []
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    with torch.no_grad():
        clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))  # [N]
        metrics = {
            **behaviour_metric_sums(log_w, is_cap),
            "clip_fraction": clipped.float().sum(),
            "tokens": torch.tensor(float(lp.numel()), device=lp.device),
        }
    return loss_sum, metrics


def policy_loss_normaliser(loss_mask: torch.Tensor, sequence_ids: torch.Tensor, *, loss_type: str = "dapo",
                           max_completion_length: int | None = None) -> float:
    """What `policy_loss_sums` is divided by: masked tokens (dapo), sequences with a masked token
    (grpo, gspo; a sequence with none, e.g. filtered, has no mean and does not count), or all
    sequences (sequence_ids >= 0) x `max_completion_length` (dr_grpo). Known before any
    forward, and additive over disjoint parts (micro-batches, ranks)."""
    mask = loss_mask.bool()
    if loss_type == "dapo":
        return float(mask.sum())
    if loss_type in ("grpo", "gspo"):
        return float(torch.unique(sequence_ids[mask]).numel())
    if loss_type == "dr_grpo":  # a constant per sequence: every sequence counts, trained tokens or not
        if not max_completion_length:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        return float(torch.unique(sequence_ids[sequence_ids >= 0]).numel()) * max_completion_length
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_correction: str = "token_truncate",
    is_cap: float = 2.0,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with a behaviour-policy correction, one row per sample: the
    reference definition (training uses `policy_loss_sums`, held to this by the tests).

    logprobs, old_logprobs, inference_logprobs, loss_mask: [B, T]; advantages: [B].
    Per token: r = exp(logprobs - old_logprobs), o = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A),
    w = exp(old_logprobs - inference_logprobs) (detached; token_truncate: min(w, is_cap),
    token_mask: w if w <= is_cap else 0, none: 1), l = -w o. Aggregated over masked tokens:
    grpo: mean over sequences of each one's token mean; dapo: sum / masked tokens;
    dr_grpo: sum / (B x max_completion_length); gspo: r is the sequence-level ratio
    exp(mean of the sequence's log-ratios), clipped per sequence, aggregated like grpo.

    `old_logprobs` are the trainer's logprobs under the weights of the batch's first update.
    With one optimizer step per batch (`GRPO(updates_per_batch=1)`, the default) they equal
    `logprobs.detach()`: r is 1 (its gradient is not) and clipping never binds. With several,
    r moves away from 1 at the later updates and the clip keeps them in a trust region. The
    off-policy part (stale or numerically different sampler) is carried by w, the correction
    against the sampler's (inference) logprobs, as in prime-rl and verl.

    Metrics: mismatch_kl (mean over masked tokens of w - log w - 1, uncapped w: 0 when the
    sampler and the trainer agree), clip_fraction (tokens whose clipped term was taken),
    is_capped_fraction (tokens with w > is_cap).
    """
    problems = check_policy_loss_options(loss_type, is_correction, clip_low, clip_high, is_cap, max_completion_length)
    if problems:
        raise ValueError("policy_loss: " + "; ".join(problems))
    rows = torch.arange(loss_mask.shape[0], device=loss_mask.device)[:, None].expand_as(loss_mask)  # [B, T]
    per_token_advantages = advantages[:, None].expand_as(logprobs)  # [B, T]
    loss_sum, sums = policy_loss_sums(
        logprobs, old_logprobs, inference_logprobs, per_token_advantages, loss_mask, rows, loss_type=loss_type,
        clip_low=clip_low, clip_high=clip_high, is_correction=is_correction, is_cap=is_cap,
    )
    normaliser = policy_loss_normaliser(loss_mask, rows, loss_type=loss_type, max_completion_length=max_completion_length)
    tokens = max(float(sums["tokens"]), 1.0)
    return loss_sum / max(normaliser, 1.0), {name: float(sums[name]) / tokens for name in POLICY_METRICS}


# ---- on-policy distillation ------------------------------------------------------------------------------
OPD_METRICS = ("reverse_kl", "mismatch_kl", "is_capped_fraction")
#: what the sampled-token estimator's advantage is centred on: nothing, or its mean over the whole step
ADVANTAGE_BASELINES = ("none", "step_mean")


def check_advantage_options(baseline: str, advantage_clip: float | None) -> list[str]:
    """Every problem with the sampled-token estimator's advantage options, for one error at start-up."""
    problems = []
    if baseline not in ADVANTAGE_BASELINES:
        problems.append(f"advantage_baseline must be one of {ADVANTAGE_BASELINES}, got {baseline!r}")
    if advantage_clip is not None and not advantage_clip > 0:
        problems.append(f"advantage_clip must be > 0 or null, got {advantage_clip}")
    return problems


def distillation_advantage(teacher_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
                           advantage_clip: float | None = None) -> torch.Tensor:
    """Each sampled token's distillation advantage, detached, any shape: teacher minus sampler
    logprob (minus the token's reverse-KL estimate), clipped to [-advantage_clip, advantage_clip]
    when given. The clip bounds what one token the teacher finds near impossible (log q of -20)
    can do to a step; it biases the estimate towards 0 for exactly those tokens."""
    advantage = (teacher_logprobs - inference_logprobs).detach()
    return advantage if advantage_clip is None else advantage.clamp(-advantage_clip, advantage_clip)


def opd_loss_sums(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    is_correction: str = "token_truncate",
    is_cap: float = 2.0,
    advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
    advantage_clip: float | None = None,
    baseline: float | torch.Tensor = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The numerator of `opd_loss` and its metric sums over masked tokens, tensors of one shape.

    Sums over any split (micro-batches, ranks) add up; divide by the masked tokens of the
    whole step. `baseline` (a number: the step's mean `distillation_advantage` for the
    ``step_mean`` baseline, computed before the split) is subtracted from every token's
    distillation advantage; `advantages` (per token, e.g. GRPO's group-relative reward
    advantage) are added to it with `reward_weight`. Metric sums: reverse_kl (inference -
    teacher), mismatch_kl, is_capped_fraction, and "tokens" (the count).
    """
    mask = loss_mask.bool()
    lp, old, inf, teacher = logprobs[mask], old_logprobs[mask], inference_logprobs[mask], teacher_logprobs[mask]  # [N]
    advantage = distillation_advantage(teacher, inf, advantage_clip) - baseline  # [N]
    if advantages is not None and reward_weight:
        advantage = advantage + reward_weight * advantages[mask].detach()  # [N]
    log_w, weight = behaviour_weight(old, inf, is_correction, is_cap)  # [N], [N]
    ratio = torch.exp(lp - old)  # [N]: 1 in value with one update per batch; its gradient is grad log p
    loss_sum = (-weight * ratio * advantage).sum()  # []
    with torch.no_grad():
        metrics = {
            "reverse_kl": (inf - teacher).sum(),
            **behaviour_metric_sums(log_w, is_cap),
            "tokens": torch.tensor(float(lp.numel()), device=lp.device),
        }
    return loss_sum, metrics


def opd_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    is_correction: str = "token_truncate",
    is_cap: float = 2.0,
    advantage_baseline: str = "none",
    advantage_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy distillation: a per-token reverse KL to a teacher, as a policy gradient: the
    reference definition (training uses `opd_loss_sums`, held to this by the tests).

    All tensors [B, T], the whole step. Per masked token: a = teacher_logprobs -
    inference_logprobs (detached; the sampled token's negative reverse KL estimate log q(x) -
    log p(x), no discount over later tokens), clipped to [-advantage_clip, advantage_clip] if
    given, minus the baseline b (``step_mean``: the mean of the clipped a over the step's masked
    tokens; ``none``: 0), r = exp(logprobs - old_logprobs), w the behaviour weight exp(old -
    inference) corrected as in `policy_loss`, l = -w r (a - b). Aggregated as the sum over masked
    tokens / their number. Metrics (means over masked tokens): reverse_kl = inference - teacher,
    mismatch_kl, is_capped_fraction.

    Why a baseline: a = -KL on average, so without one nearly every sampled token is pushed
    down, and only the noise of which tokens were sampled decides where the mass goes. A
    constant b changes nothing in expectation (E_p[grad log p] = 0 at every position) and
    removes that noise; from the step's own tokens it is off by one token in N (N: thousands).
    """
    problems = check_behaviour_options(is_correction, is_cap) + check_advantage_options(advantage_baseline, advantage_clip)
    if problems:
        raise ValueError("opd_loss: " + "; ".join(problems))
    mask = loss_mask.bool()
    baseline = 0.0
    if advantage_baseline == "step_mean" and mask.any():
        baseline = distillation_advantage(teacher_logprobs[mask], inference_logprobs[mask], advantage_clip).mean()
    loss_sum, sums = opd_loss_sums(logprobs, old_logprobs, inference_logprobs, teacher_logprobs, loss_mask,
                                   is_correction=is_correction, is_cap=is_cap, advantage_clip=advantage_clip,
                                   baseline=baseline)
    tokens = max(float(sums["tokens"]), 1.0)
    return loss_sum / tokens, {name: float(sums[name]) / tokens for name in OPD_METRICS}


# ---- dense distillation: a divergence over the whole next-token distribution ------------------------------
# What OPD's `divergence` option accepts: the sampled-token estimator above, or a divergence computed
# exactly over the vocabulary from the student's and the teacher's logits (each a `beta` of `token_divergence`).
DENSE_DIVERGENCES = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": None}  # None: the `beta` option
DIVERGENCES = ("sampled_reverse_kl", *DENSE_DIVERGENCES)


def check_divergence_options(divergence: str, beta: float) -> list[str]:
    """Every problem with OPD's divergence options, for one error at start-up."""
    problems = []
    if divergence not in DIVERGENCES:
        problems.append(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if not 0.0 <= beta <= 1.0:
        problems.append(f"beta must be in [0, 1], got {beta}")
    return problems


def divergence_beta(divergence: str, beta: float) -> float:
    """The `token_divergence` beta a dense divergence name stands for (`jsd` takes `beta`)."""
    fixed = DENSE_DIVERGENCES[divergence]
    return beta if fixed is None else fixed


def token_divergence(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalised Jensen-Shannon divergence of each position's next-token distributions, as in
    TRL's DistillationTrainer (Agarwal et al. 2024, "On-Policy Distillation of Language Models").

    student_logprobs, teacher_logprobs: [N, V], each row log-normalised. Returns [N], float32:
    - beta 0: forward KL(teacher || student) = sum_v t_v (log t_v - log s_v);
    - beta 1: reverse KL(student || teacher) = sum_v s_v (log s_v - log t_v);
    - otherwise beta KL(teacher || m) + (1 - beta) KL(student || m), m = (1 - beta) s + beta t.
    The endpoints are the KLs themselves, not the limit of the mixture form (which tends to 0 there).
    Differentiable in the student's log-probabilities; the teacher's should come detached.
    """
    s, t = student_logprobs.float(), teacher_logprobs.float()  # [N, V]

    def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:  # KL(p || q) per row; log-softmax is finite
        return (log_p.exp() * (log_p - log_q)).sum(-1)  # [N]

    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    m = torch.logaddexp(s + torch.log1p(torch.tensor(-beta)), t + torch.log(torch.tensor(beta)))  # [N, V]
    return beta * kl(t, m) + (1.0 - beta) * kl(s, m)  # [N]


# ---- dense distillation from a teacher server: the teacher's top-k tokens and a tail bin ----------------
#: the mass added to each distribution's tail bin, so that its log is finite when the top k hold (up to
#: rounding) all of it; with k = V the divergence then equals the full-vocabulary one to ~1e-7 per position.
TAIL_FLOOR = 1e-6


def topk_bins(student_logprobs: torch.Tensor, topk_ids: torch.Tensor,
              teacher_topk_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both next-token distributions coarsened to k + 1 bins: the teacher's top-k tokens, then one
    bin for the rest of the vocabulary, as log-probabilities for `token_divergence`.

    student_logprobs [N, V] (log-normalised over the whole vocabulary), topk_ids [N, k] (long),
    teacher_topk_logprobs [N, k] (the teacher server's log-probabilities of those tokens). Returns
    ([N, k + 1], [N, k + 1]) float32: the student's and the teacher's log-probability of each top-k
    token, then log(tail mass + TAIL_FLOOR), where the tail mass is 1 minus the top-k's mass (the
    student's computed exactly from its logits outside the top k, the teacher's from its top k).
    The coarsened divergence is at most the full one (data processing; up to the floor), equal when k = V.
    """
    s = student_logprobs.float()  # [N, V]
    s_top = s.gather(-1, topk_ids)  # [N, k]
    floor = torch.full_like(s[:, :1], math.log(TAIL_FLOOR))  # [N, 1]
    # The student's tail from its own logits outside the top k (exact and differentiable, also
    # when the top k hold nearly everything); the floor column keeps the logsumexp finite.
    s_tail = torch.logsumexp(torch.cat([s.scatter(-1, topk_ids, float("-inf")), floor], dim=-1), dim=-1, keepdim=True)
    t_top = teacher_topk_logprobs.float()  # [N, k]
    t_mass = (-torch.expm1(torch.logsumexp(t_top, dim=-1, keepdim=True))).clamp_min(0.0)  # [N, 1]
    t_tail = torch.log(t_mass + TAIL_FLOOR)  # [N, 1]
    return torch.cat([s_top, s_tail], dim=-1), torch.cat([t_top, t_tail], dim=-1)
