"""The chunked output head against full logits: values and gradients, every chunking.

Reference: `log_softmax((hidden @ weight.T + bias).float())` gathered at the targets, and
autograd through it. Tolerances: float32 1e-5 (values and gradients; plus 1e-6 relative
for the sums over positions and chunks, whose float32 rounding depends on the order); bfloat16 compares
against the same reference computed in bfloat16 (logits rounded to bfloat16, softmax in
float32), to 2e-2 absolute on log-probabilities (a bfloat16 logit carries ~3 significant
digits) and 2e-2 of the largest gradient entry.
"""

import pytest
import torch

from lit_rl.chunked_head import selected_cross_entropy_sum, selected_token_logprobs

N, H, V = 37, 16, 101


def inputs(dtype=torch.float32, bias=False, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (n,), generator=g)
    return hidden, weight, b, targets


def reference(hidden, weight, bias, targets):
    logits = hidden @ weight.T if bias is None else hidden @ weight.T + bias  # [N, V]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)  # [N], [N]


def params(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None]


@pytest.mark.parametrize("chunk_size", [1, 7, N, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_logprobs_and_entropy_equal_full_logits_with_gradients(chunk_size, bias):
    hidden, weight, b, targets = inputs(bias=bias)
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)  # arbitrary upstream gradients
    want_lp, want_ent = reference(hidden, weight, b, targets)
    want_grads = torch.autograd.grad((want_lp * up_lp).sum() + (want_ent * up_ent).sum(), params(hidden, weight, b))
    lp, ent = selected_token_logprobs(hidden, weight, targets, bias=b, chunk_size=chunk_size, with_entropy=True)
    grads = torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), params(hidden, weight, b))
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_logprobs_without_entropy_and_only_some_inputs_needing_gradients():
    hidden, weight, _, targets = inputs()
    weight.requires_grad_(False)  # e.g. a frozen head
    lp, ent = selected_token_logprobs(hidden, weight, targets, chunk_size=5)
    assert ent is None
    (grad,) = torch.autograd.grad(lp.sum(), [hidden])
    want_lp, _ = reference(hidden, weight, None, targets)
    (want,) = torch.autograd.grad(want_lp.sum(), [hidden])
    torch.testing.assert_close(grad, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_cross_entropy_sum_equals_full_logits_with_gradients(chunk_size, bias):
    hidden, weight, b, targets = inputs(bias=bias)
    want_lp, _ = reference(hidden, weight, b, targets)
    want = -want_lp.sum()
    want_grads = torch.autograd.grad(3.0 * want, params(hidden, weight, b))  # the module scales the sum
    got = selected_cross_entropy_sum(hidden, weight, targets, bias=b, chunk_size=chunk_size)
    grads = torch.autograd.grad(3.0 * got, params(hidden, weight, b))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-6)


def test_no_positions_and_no_grad():
    hidden, weight, _, targets = inputs(n=0)
    lp, ent = selected_token_logprobs(hidden, weight, targets, with_entropy=True)
    assert lp.shape == ent.shape == (0,)
    assert selected_cross_entropy_sum(hidden, weight, targets).item() == 0.0
    hidden, weight, _, targets = inputs()
    with torch.no_grad():
        loss = selected_cross_entropy_sum(hidden, weight, targets, chunk_size=4)
    assert not loss.requires_grad
    assert loss.item() == pytest.approx(-reference(hidden, weight, None, targets)[0].sum().item(), rel=1e-6)


def test_bfloat16_within_stated_tolerance():
    hidden, weight, _, targets = inputs(dtype=torch.bfloat16)
    want_lp, want_ent = reference(hidden, weight, None, targets)
    want_grads = torch.autograd.grad(want_lp.sum() + want_ent.sum(), [hidden, weight])
    lp, ent = selected_token_logprobs(hidden, weight, targets, chunk_size=8, with_entropy=True)
    grads = torch.autograd.grad(lp.sum() + ent.sum(), [hidden, weight])
    assert lp.dtype == torch.float32 and grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(lp, want_lp, atol=2e-2, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=2e-2, rtol=0)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2 * w.float().abs().max().item(), rtol=0)
    loss = selected_cross_entropy_sum(hidden, weight, targets, chunk_size=8)
    torch.testing.assert_close(loss, -want_lp.sum(), atol=2e-2 * N, rtol=0)


def test_bad_shapes_are_named():
    hidden, weight, _, targets = inputs()
    with pytest.raises(ValueError, match="targets must be"):
        selected_token_logprobs(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="weight"):
        selected_cross_entropy_sum(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="chunk_size"):
        selected_cross_entropy_sum(hidden, weight, targets, chunk_size=0)


def test_an_entropy_that_is_only_logged_costs_no_backward():
    """The RL losses log the entropy but train on the logprobs: the backward of a loss of the
    logprobs alone does the same work with and without the entropy computed (counted in the
    profiler: the entropy's gradient is one more [C, V] addcmul per chunk), and the same gradient."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(12, 8, generator=g), torch.randn(40, 8, generator=g)
    targets = torch.randint(0, 40, (12,), generator=g)

    def backward_ops(with_entropy: bool):
        h = hidden.clone().requires_grad_()
        lp, ent = selected_token_logprobs(h, weight, targets, chunk_size=4, with_entropy=with_entropy)
        with torch.profiler.profile() as prof:
            lp.sum().backward()
        calls = sum(e.count for e in prof.key_averages() if e.key == "aten::addcmul_")
        return calls, h.grad, ent

    plain_calls, plain_grad, _ = backward_ops(False)
    logged_calls, logged_grad, entropy = backward_ops(True)
    assert entropy is not None and plain_calls == 3  # one per chunk of 4 positions
    assert logged_calls == plain_calls
    torch.testing.assert_close(logged_grad, plain_grad)
