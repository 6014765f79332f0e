"""policy_loss against numbers worked out by hand, and against a token-by-token float reference."""

import math

import pytest
import torch

from lit_rl.losses import LOSS_TYPES, policy_loss, policy_loss_normaliser, policy_loss_sums

LN = math.log


def one_row():
    """One sequence, tokens 1 and 2 trained, A = +1.
    token 1: r = 1.5 (above 1 + 0.28: clipped to 1.28), w = exp(0 - ln 0.5) = 2
    token 2: r = 0.9 (inside the range),              w = exp(0 - ln 0.25) = 4
    """
    lp = torch.tensor([[0.0, LN(1.5), LN(0.9)]], requires_grad=True)
    old = torch.zeros(1, 3)
    inf = torch.tensor([[0.0, LN(0.5), LN(0.25)]])
    mask = torch.tensor([[False, True, True]])
    return lp, old, inf, torch.tensor([1.0]), mask


@pytest.mark.parametrize(
    "correction, want_loss, want_grad",
    [
        # l1 = -2 * 1.28 (clipped: no gradient), l2 = -min(4, 2) * 0.9; mean over 2 tokens
        ("token_truncate", (-2.56 - 1.8) / 2, [0.0, 0.0, -2 * 0.9 / 2]),
        # w2 = 4 > 2 is masked out
        ("token_mask", (-2.56 + 0.0) / 2, [0.0, 0.0, 0.0]),
        ("none", (-1.28 - 0.9) / 2, [0.0, 0.0, -0.9 / 2]),
    ],
)
def test_dapo_by_hand_for_each_correction(correction, want_loss, want_grad):
    lp, old, inf, adv, mask = one_row()
    loss, metrics = policy_loss(lp, old, inf, adv, mask, loss_type="dapo", is_correction=correction)
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0].tolist() == pytest.approx(want_grad, abs=1e-6)  # d/d logp = d/dr * r
    assert metrics["mismatch_kl"] == pytest.approx(((2 - LN(2) - 1) + (4 - LN(4) - 1)) / 2, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["is_capped_fraction"] == pytest.approx(0.5)


def two_rows():
    """Row 0: 2 trained tokens, A = +1; row 1: 3 trained tokens, A = -0.5. Ratios inside the
    clip range except row 1's last (0.7 < 0.8 with A < 0: clipped). w = 1 everywhere."""
    lp = torch.tensor([[0.0, LN(1.1), LN(1.2), 0.0], [0.0, LN(0.9), LN(1.0), LN(0.7)]], requires_grad=True)
    old = torch.zeros(2, 4)
    mask = torch.tensor([[False, True, True, False], [False, True, True, True]])
    return lp, old, old.clone(), torch.tensor([1.0, -0.5]), mask


def test_grpo_dr_grpo_and_gspo_by_hand():
    lp, old, inf, adv, mask = two_rows()
    row0 = [-1.1, -1.2]  # l = -r A
    row1 = [0.45, 0.5, 0.4]  # -r A with A = -0.5; the last takes the clipped 0.8 (min of -0.35, -0.4)
    loss, _ = policy_loss(lp, old, inf, adv, mask, loss_type="grpo")
    assert loss.item() == pytest.approx((sum(row0) / 2 + sum(row1) / 3) / 2, abs=1e-6)
    loss, _ = policy_loss(lp, old, inf, adv, mask, loss_type="dapo")
    assert loss.item() == pytest.approx((sum(row0) + sum(row1)) / 5, abs=1e-6)
    loss, _ = policy_loss(lp, old, inf, adv, mask, loss_type="dr_grpo", max_completion_length=10)
    assert loss.item() == pytest.approx((sum(row0) + sum(row1)) / (2 * 10), abs=1e-6)
    # gspo: one ratio per sequence, exp(mean log-ratio): row 0 sqrt(1.1 * 1.2) = 1.1489 (inside),
    # row 1 (0.9 * 1.0 * 0.7) ** (1/3) = 0.8573 (inside)
    r0, r1 = math.sqrt(1.1 * 1.2), (0.9 * 0.7) ** (1 / 3)
    loss, _ = policy_loss(lp, old, inf, adv, mask, loss_type="gspo")
    assert loss.item() == pytest.approx((-r0 * 1.0 + r1 * 0.5) / 2, abs=1e-6)
    # ... and clipped per sequence: row 0 with ratios 1.3 and 1.4 -> sqrt(1.82) = 1.349 > 1.28
    lp2 = lp.detach().clone()
    lp2[0, 1], lp2[0, 2] = LN(1.3), LN(1.4)
    loss, metrics = policy_loss(lp2, old, inf, adv, mask, loss_type="gspo")
    assert loss.item() == pytest.approx((-1.28 + r1 * 0.5) / 2, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)  # both tokens of row 0


def reference(lp, old, inf, adv, mask, loss_type, clip_low, clip_high, correction, cap, max_len):
    """Token by token in Python floats."""
    per_seq, n_tokens = [], 0
    for b in range(len(lp)):
        tokens = [t for t in range(len(lp[0])) if mask[b][t]]
        if not tokens:
            continue
        n_tokens += len(tokens)
        seq_log_ratio = sum(lp[b][t] - old[b][t] for t in tokens) / len(tokens)
        losses = []
        for t in tokens:
            r = math.exp(seq_log_ratio if loss_type == "gspo" else lp[b][t] - old[b][t])
            a = adv[b]
            o = min(r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a)
            w = math.exp(old[b][t] - inf[b][t])
            w = {"token_truncate": min(w, cap), "token_mask": w if w <= cap else 0.0, "none": 1.0}[correction]
            losses.append(-w * o)
        per_seq.append(losses)
    if loss_type in ("grpo", "gspo"):
        return sum(sum(x) / len(x) for x in per_seq) / len(per_seq)
    if loss_type == "dapo":
        return sum(map(sum, per_seq)) / n_tokens
    return sum(map(sum, per_seq)) / (len(lp) * max_len)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("correction", ["token_truncate", "token_mask", "none"])
def test_random_batches_match_the_token_by_token_reference(loss_type, correction):
    g = torch.Generator().manual_seed(0)
    B, T = 5, 9
    old = -torch.rand(B, T, generator=g) * 3
    lp = old + torch.randn(B, T, generator=g) * 0.3
    inf = old + torch.randn(B, T, generator=g) * 0.6
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.4
    mask[:, 0] = False
    loss, _ = policy_loss(lp, old, inf, adv, mask, loss_type=loss_type, is_correction=correction, max_completion_length=12)
    want = reference(lp.tolist(), old.tolist(), inf.tolist(), adv.tolist(), mask.tolist(), loss_type, 0.2, 0.28,
                     correction, 2.0, 12)
    assert loss.item() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sums_over_parts_equal_the_whole(loss_type):
    """What the module relies on: sums over disjoint sets of sequences, divided by the summed
    normaliser, equal the loss of all of them at once (values and gradients)."""
    g = torch.Generator().manual_seed(1)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g) * 2
    lp = (old + torch.randn(B, T, generator=g) * 0.2).requires_grad_()
    inf = old + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    whole, _ = policy_loss(lp, old, inf, adv, mask, loss_type=loss_type, max_completion_length=T)
    (want_grad,) = torch.autograd.grad(whole, lp)
    rows = torch.arange(B)[:, None].expand(B, T)
    kw = {"loss_type": loss_type, "max_completion_length": T}
    norm = sum(policy_loss_normaliser(mask[p], rows[p], **kw) for p in (slice(0, 2), slice(2, 6)))
    total = sum(
        policy_loss_sums(lp[p], old[p], inf[p], adv[p, None].expand(-1, T), mask[p], rows[p], loss_type=loss_type)[0]
        for p in (slice(0, 2), slice(2, 6))
    ) / norm
    (grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(grad, want_grad, atol=1e-7, rtol=0)


def test_with_old_equal_to_detached_logprobs_the_ratio_is_one_but_has_a_gradient():
    lp, _, inf, adv, mask = two_rows()
    loss, metrics = policy_loss(lp, lp.detach(), inf, adv, mask, loss_type="dapo")
    assert metrics["clip_fraction"] == 0.0
    (grad,) = torch.autograd.grad(loss, lp)
    w = torch.exp(lp.detach() - inf)  # the behaviour weight, below the cap of 2 everywhere here
    want = torch.where(mask, -w * adv[:, None] / 5, torch.zeros_like(lp))  # -w A / tokens
    torch.testing.assert_close(grad, want, atol=1e-7, rtol=0)


def test_bad_options_are_reported_together():
    lp, old, inf, adv, mask = one_row()
    with pytest.raises(ValueError) as e:
        policy_loss(lp, old, inf, adv, mask, loss_type="ppo", is_correction="seq", is_cap=0)
    assert "loss_type" in str(e.value) and "is_correction" in str(e.value) and "is_cap" in str(e.value)
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(lp, old, inf, adv, mask, loss_type="dr_grpo")


@pytest.mark.parametrize("options", [{"is_cap": math.nan}, {"clip_high": math.nan}])
def test_a_nan_option_is_refused(options):
    """A YAML `.nan` passes jsonargparse's float, and `is_cap <= 0` or `clip_high < 0` let it through:
    every token's loss was then NaN, a failed run at the first step."""
    lp, old, inf, adv, mask = one_row()
    with pytest.raises(ValueError, match="is_cap must be > 0, got nan|clip_high >= 0, got clip_low=0.2, clip_high=nan"):
        policy_loss(lp, old, inf, adv, mask, **options)
