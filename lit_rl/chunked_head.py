"""The output head applied only where a token is trained, a chunk of positions at a time.

A real vocabulary makes the head the largest tensor of a training step: Qwen3 has
151,936 rows, so full logits of 8 rows of 1,024 tokens are 5 GB in float32, and
their log-softmax, gradient and any entropy each as much again. Losses need the
head only at positions whose next token is trained. These pure functions take the
decoder's hidden states at those positions, `[N, H]`, and the head weight, `[V, H]`
(tied to the embedding or not), and never build more than `[chunk_size, V]` of logits
at once.

- `selected_token_logprobs`: per-token log-probabilities (and optionally entropies)
  of given tokens, for the RL losses. Logits are recomputed chunk by chunk in backward
  instead of kept: the price is one more head matmul, the gain is memory that does
  not grow with the number of trained tokens.
- `selected_cross_entropy_sum`: the SFT loss. Its gradient with respect to a chunk's
  logits (`softmax - onehot`) does not depend on anything downstream but one scalar,
  so it is computed in the forward pass while the chunk's logits are at hand and
  scaled in backward: no recomputation, three head matmuls like the unchunked loss.
- `selected_divergence_sum`: dense distillation, a divergence between the student's and a
  teacher's whole next-token distributions (`lit_rl.losses.token_divergence`), each model's head
  applied to its own hidden states; each chunk is recomputed in backward (checkpointing).

Both compute logits in the weight's dtype (as the model's own head does) and the
softmax in float32, like `log_softmax(logits.float())` on full logits.
"""

from __future__ import annotations

import torch

from lit_rl.sampling_process import RAW, SamplingProcess

DEFAULT_CHUNK_SIZE = 1024


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}]; got {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)  # [C, V] in the weight's dtype
    return logits.float()  # [C, V]


def _grad_buffer(t: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
    """Float32 accumulator for a parameter's gradient (bfloat16 sums over chunks lose precision)."""
    return torch.zeros(t.shape, dtype=torch.float32, device=t.device) if needed and t is not None else None


def _accumulate(buffer: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """buffer += a @ b, the product in the inputs' dtype (as autograd on full logits would do)."""
    if buffer.dtype == a.dtype:
        buffer.addmm_(a, b)
    else:
        buffer.add_(a @ b)


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, with_entropy, process):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None  # [N]
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            logits = process.apply(_chunk_logits(hidden[a:b], weight, bias), targets[a:b])  # [C, V]
            lse[a:b] = torch.logsumexp(logits, dim=-1)  # [C]
            logprobs[a:b] = logits.gather(-1, targets[a:b, None]).squeeze(-1) - lse[a:b]  # [C]
            if with_entropy:
                logp = logits.sub_(lse[a:b, None])  # [C, V], in place: logits are not needed any more
                entropy[a:b] = -(logp.exp() * logp).sum(-1)  # [C]
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk_size, ctx.process = chunk_size, process
        ctx.mark_non_differentiable(targets)
        # An output the loss does not use (the entropy, logged only) then reaches backward as None,
        # not as zeros, and its backward pass over every chunk's [C, V] is skipped.
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_h else None  # [N, H]
        grad_weight, grad_bias = _grad_buffer(weight, need_w), _grad_buffer(bias, need_b)  # [V, H], [V]
        for a in range(0, hidden.shape[0], ctx.chunk_size):
            b = min(a + ctx.chunk_size, hidden.shape[0])
            h = hidden[a:b]  # [C, H]
            # the processed logits again: the same kept tokens as in forward (a pure function of the logits)
            logp = ctx.process.apply(_chunk_logits(h, weight, bias), targets[a:b]).sub_(lse[a:b, None])  # [C, V]
            p = logp.exp()  # [C, V]: 0 where top-k / top-p dropped a token
            # d logp(target) / d processed logits = onehot(target) - p
            grad_logits = torch.zeros_like(p)  # [C, V]
            if grad_logprobs is not None:
                g = grad_logprobs[a:b, None]  # [C, 1]
                grad_logits.addcmul_(p, g, value=-1.0)
                grad_logits.scatter_add_(-1, targets[a:b, None], g)
            # d entropy / d processed logits = -p * (logp + entropy)
            if grad_entropy is not None and entropy is not None:
                logp.add_(entropy[a:b, None]).mul_(p)  # [C, V]: p * (logp + H)
                grad_logits.addcmul_(logp, grad_entropy[a:b, None], value=-1.0)
            if ctx.process.temperature != 1.0:  # processed = logits / T, dropped tokens carry no gradient
                grad_logits.div_(ctx.process.temperature)
            grad_logits = grad_logits.to(weight.dtype)  # [C, V]
            if need_h:
                grad_hidden[a:b] = grad_logits @ weight  # [C, H]
            if need_w:
                _accumulate(grad_weight, grad_logits.T, h)  # [V, H]
            if need_b:
                grad_bias.add_(grad_logits.sum(0, dtype=torch.float32))  # [V]
        to = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grad_hidden, to(grad_weight, weight), to(grad_bias, bias) if bias is not None else None, None, None, None, None


def selected_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    process: SamplingProcess = RAW,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of `targets` under `hidden @ weight.T + bias`, and optionally the entropy
    of each position's distribution, computed `chunk_size` positions at a time.

    hidden [N, H] (the decoder's final hidden states at the selected positions), weight [V, H],
    bias [V] or None, targets [N] (token ids). Returns (logprobs [N], entropy [N] or None), both
    float32 and differentiable. Equal to ``log_softmax(full logits.float()).gather(targets)``;
    with a `process` (temperature, top-k, top-p: `lit_rl.sampling_process`), of the distribution
    the sampler drew from, ``log_softmax(process.apply(full logits, targets)).gather(targets)``.
    """
    _check(hidden, weight, targets, chunk_size)
    return _SelectedLogprobs.apply(hidden, weight, bias, targets, chunk_size, with_entropy, process)


class _SelectedCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, need_grads):
        n = hidden.shape[0]
        need_h, need_w, need_b = need_grads
        grad_hidden = torch.empty_like(hidden) if need_h else None  # [N, H]
        grad_weight, grad_bias = _grad_buffer(weight, need_w), _grad_buffer(bias, need_b)  # [V, H], [V]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)  # []
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            h, t = hidden[a:b], targets[a:b, None]  # [C, H], [C, 1]
            logits = _chunk_logits(h, weight, bias)  # [C, V]
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [C, 1]
            total += (lse - logits.gather(-1, t)).sum()  # []
            if any(need_grads):
                # d CE / d logits = softmax - onehot(target), built in place of the logits
                grad_logits = logits.sub_(lse).exp_()  # [C, V]
                grad_logits.scatter_add_(-1, t, torch.full_like(lse, -1.0))
                grad_logits = grad_logits.to(weight.dtype)  # [C, V]
                if need_h:
                    grad_hidden[a:b] = grad_logits @ weight  # [C, H]
                if need_w:
                    _accumulate(grad_weight, grad_logits.T, h)  # [V, H]
                if need_b:
                    grad_bias.add_(grad_logits.sum(0, dtype=torch.float32))  # [V]
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        # Scaled in place: the buffers are this call's own and released here, so a [V, H] weight
        # gradient is not held twice next to the one autograd accumulates into.
        grads = tuple(None if g is None else g.mul_(grad_total).to(dt) for g, dt in zip(ctx.grads, ctx.dtypes))
        ctx.grads = None
        return (*grads, None, None, None)


def selected_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Sum over positions of the cross-entropy of `targets` under `hidden @ weight.T + bias`.

    hidden [N, H], weight [V, H], bias [V] or None, targets [N]. Returns a float32 scalar.
    Gradients are computed chunk by chunk during this call when autograd needs them and only
    scaled in backward, so call it once per backward (as a loss), not inside a loop that
    discards most results.
    """
    _check(hidden, weight, targets, chunk_size)
    enabled = torch.is_grad_enabled()
    need = tuple(enabled and t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _SelectedCrossEntropySum.apply(hidden, weight, bias, targets, chunk_size, need)


def _chunk_divergence(student_h, student_w, student_b, teacher_h, teacher_w, teacher_b, beta):
    """Divergence sum of one chunk of positions; recomputed in backward (`selected_divergence_sum`)."""
    from lit_rl.losses import token_divergence

    student = torch.log_softmax(_chunk_logits(student_h, student_w, student_b), dim=-1)  # [C, V]
    with torch.no_grad():
        teacher = torch.log_softmax(_chunk_logits(teacher_h, teacher_w, teacher_b), dim=-1)  # [C, V]
    return token_divergence(student, teacher, beta).sum()  # []


def selected_divergence_sum(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Sum over positions of `lit_rl.losses.token_divergence` between the student's and the
    teacher's next-token distributions, each model's head applied to its own hidden states.

    student_hidden [N, Hs], student_weight [V, Hs]; teacher_hidden [N, Ht], teacher_weight [V, Ht]
    (the widths may differ, the vocabulary may not); biases [V] or None. Differentiable in the
    student's tensors only. Returns a float32 scalar. Each chunk's forward is recomputed in
    backward (activation checkpointing): at most one chunk's `[chunk_size, V]` logits, log-probs and
    their gradients live at once, for the price of a second pass of both heads; the loss is the
    reference definition itself, applied a chunk at a time.
    """
    from torch.utils.checkpoint import checkpoint

    _check(student_hidden, student_weight, student_hidden.new_zeros(student_hidden.shape[0], dtype=torch.long), chunk_size)
    if teacher_hidden.shape[0] != student_hidden.shape[0] or teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"teacher and student must score the same positions over the same vocabulary; got hidden "
                         f"{tuple(teacher_hidden.shape)} vs {tuple(student_hidden.shape)}, heads "
                         f"{tuple(teacher_weight.shape)} vs {tuple(student_weight.shape)}")
    teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()
    teacher_bias = None if teacher_bias is None else teacher_bias.detach()
    # A zero tied to the student's tensors: with no position (a stand-in micro-batch) the backward
    # still runs through the model, as FSDP's gradient reduction and DDP's sync expect of every rank.
    total = 0.0 * (student_hidden.float().sum() + student_weight.float().sum())  # []
    for a in range(0, student_hidden.shape[0], chunk_size):
        b = min(a + chunk_size, student_hidden.shape[0])
        total = total + checkpoint(_chunk_divergence, student_hidden[a:b], student_weight, student_bias,
                                   teacher_hidden[a:b], teacher_weight, teacher_bias, beta, use_reentrant=False)
    return total


def _chunk_topk_divergence(student_h, student_w, student_b, topk_ids, teacher_topk_logprobs, beta):
    """Top-k divergence sum of one chunk of positions; recomputed in backward (`selected_topk_divergence_sum`)."""
    from lit_rl.losses import token_divergence, topk_bins

    student = torch.log_softmax(_chunk_logits(student_h, student_w, student_b), dim=-1)  # [C, V]
    return token_divergence(*topk_bins(student, topk_ids, teacher_topk_logprobs), beta).sum()  # []


def selected_topk_divergence_sum(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    *,
    beta: float,
    student_bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Sum over positions of `lit_rl.losses.token_divergence` between the student's and a teacher
    server's distributions coarsened to the teacher's top-k tokens and a tail bin
    (`lit_rl.losses.topk_bins`).

    student_hidden [N, H], student_weight [V, H], student_bias [V] or None; topk_ids [N, k] (long),
    teacher_topk_logprobs [N, k]. Differentiable in the student's tensors. Returns a float32 scalar;
    at most one chunk's `[chunk_size, V]` logits live at once (recomputed in backward).
    """
    from torch.utils.checkpoint import checkpoint

    _check(student_hidden, student_weight, student_hidden.new_zeros(student_hidden.shape[0], dtype=torch.long), chunk_size)
    if topk_ids.shape != teacher_topk_logprobs.shape or topk_ids.shape[0] != student_hidden.shape[0]:
        raise ValueError(f"the teacher's top-k ids {tuple(topk_ids.shape)} and log-probabilities "
                         f"{tuple(teacher_topk_logprobs.shape)} must be [positions, k] for {student_hidden.shape[0]} positions")
    total = 0.0 * (student_hidden.float().sum() + student_weight.float().sum())  # [] tied to the student (as above)
    for a in range(0, student_hidden.shape[0], chunk_size):
        b = min(a + chunk_size, student_hidden.shape[0])
        total = total + checkpoint(_chunk_topk_divergence, student_hidden[a:b], student_weight, student_bias,
                                   topk_ids[a:b], teacher_topk_logprobs[a:b].detach(), beta, use_reentrant=False)
    return total
