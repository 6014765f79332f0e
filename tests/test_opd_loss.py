"""opd_loss against numbers worked out by hand."""

import math

import pytest
import torch

from lit_rl.losses import opd_loss, opd_loss_sums

LN = math.log


def rows():
    """Two rows; trained tokens: row 0 tokens 1, 2; row 1 token 1 (token 2 is padding).
    Trainer == old (one update per batch), so r = 1.
      row 0 token 1: inference ln 0.5, teacher ln 0.25 -> a = ln 0.5 = -0.693; w = exp(ln 1 - ln 0.5) = 2
      row 0 token 2: inference ln 0.8, teacher ln 0.4  -> a = ln 0.5;          w = 1.25
      row 1 token 1: inference ln 0.2, teacher ln 0.6  -> a = ln 3 = 1.099;    w = 5 (> is_cap 2)
    """
    lp = torch.zeros(2, 3, requires_grad=True)
    inf = torch.tensor([[0.0, LN(0.5), LN(0.8)], [0.0, LN(0.2), 0.0]])
    teacher = torch.tensor([[0.0, LN(0.25), LN(0.4)], [0.0, LN(0.6), 0.0]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    return lp, inf, teacher, mask


@pytest.mark.parametrize(
    "correction, weights",
    [("token_truncate", [2.0, 1.25, 2.0]), ("token_mask", [2.0, 1.25, 0.0]), ("none", [1.0, 1.0, 1.0])],
)
def test_opd_loss_by_hand(correction, weights):
    lp, inf, teacher, mask = rows()
    loss, metrics = opd_loss(lp, lp.detach(), inf, teacher, mask, is_correction=correction)
    a = [LN(0.5), LN(0.5), LN(3.0)]
    want = sum(-w * 1.0 * x for w, x in zip(weights, a)) / 3  # l = -w r a, mean over the 3 trained tokens
    assert loss.item() == pytest.approx(want, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, lp)
    # d l / d logp = -w a r (r = exp(logp - old) = 1), / 3; untrained positions get nothing
    want_grad = [[0.0, -weights[0] * a[0] / 3, -weights[1] * a[1] / 3], [0.0, -weights[2] * a[2] / 3, 0.0]]
    assert grad.tolist() == [pytest.approx(row, abs=1e-6) for row in want_grad]
    assert metrics["reverse_kl"] == pytest.approx((LN(2) + LN(2) - LN(3)) / 3, abs=1e-6)  # inference - teacher
    assert metrics["mismatch_kl"] == pytest.approx(sum(w - LN(w) - 1 for w in (2.0, 1.25, 5.0)) / 3, abs=1e-6)
    assert metrics["is_capped_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("clip", [None, 0.9])
def test_the_step_mean_baseline_and_the_clip_by_hand(clip):
    """a = [ln 0.5, ln 0.5, ln 3] = [-0.693, -0.693, 1.099]; clipped at 0.9: [-0.693, -0.693, 0.9].
    The baseline is their mean b; each token's loss -w r (a - b) (weights 1: no correction)."""
    lp, inf, teacher, mask = rows()
    a = [LN(0.5), LN(0.5), LN(3.0) if clip is None else 0.9]
    b = sum(a) / 3
    loss, metrics = opd_loss(lp, lp.detach(), inf, teacher, mask, is_correction="none", advantage_baseline="step_mean",
                             advantage_clip=clip)
    assert loss.item() == pytest.approx(-sum(x - b for x in a) / 3, abs=1e-6)  # 0: a - b sums to 0 when w = 1
    (grad,) = torch.autograd.grad(loss, lp)
    want_grad = [[0.0, -(a[0] - b) / 3, -(a[1] - b) / 3], [0.0, -(a[2] - b) / 3, 0.0]]
    assert grad.tolist() == [pytest.approx(row, abs=1e-6) for row in want_grad]
    assert (a[0] - b) < 0 < (a[2] - b)  # the token the teacher likes better than average is pushed up
    assert metrics["reverse_kl"] == pytest.approx((LN(2) + LN(2) - LN(3)) / 3, abs=1e-6)  # the metric is never clipped


def test_the_clip_alone_bounds_each_advantage():
    lp, inf, teacher, mask = rows()
    loss, _ = opd_loss(lp, lp.detach(), inf, teacher, mask, is_correction="none", advantage_clip=0.5)
    assert loss.item() == pytest.approx(-(-0.5 - 0.5 + 0.5) / 3, abs=1e-6)


def test_the_ratio_carries_the_gradient_when_the_trainer_moved():
    """Several updates per batch: r = exp(logp - old) != 1 scales the token's loss and gradient."""
    lp = torch.tensor([[0.0, LN(1.5)]], requires_grad=True)
    old = torch.zeros(1, 2)
    inf = torch.zeros(1, 2)
    teacher = torch.tensor([[0.0, -1.0]])
    mask = torch.tensor([[False, True]])
    loss, _ = opd_loss(lp, old, inf, teacher, mask, is_correction="none")
    assert loss.item() == pytest.approx(-1.5 * -1.0)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0, 1].item() == pytest.approx(1.5)  # d(-r a)/d logp = -a r


def test_sums_add_up_over_splits_and_mix_in_a_reward_advantage():
    lp, inf, teacher, mask = rows()
    adv = torch.tensor([[0.0, 1.0, 1.0], [0.0, -2.0, 0.0]])
    whole, sums = opd_loss_sums(lp, lp.detach(), inf, teacher, mask, is_correction="none", advantages=adv, reward_weight=0.5)
    parts = [opd_loss_sums(lp[i:i + 1], lp.detach()[i:i + 1], inf[i:i + 1], teacher[i:i + 1], mask[i:i + 1],
                           is_correction="none", advantages=adv[i:i + 1], reward_weight=0.5) for i in (0, 1)]
    assert sum(p[0] for p in parts).item() == pytest.approx(whole.item(), abs=1e-6)
    assert sum(p[1]["tokens"] for p in parts).item() == sums["tokens"].item() == 3
    a = [LN(0.5) + 0.5, LN(0.5) + 0.5, LN(3.0) - 1.0]  # distillation advantage + 0.5 x reward advantage
    assert whole.item() == pytest.approx(-sum(a), abs=1e-6)


def test_bad_options_are_refused():
    lp, inf, teacher, mask = rows()
    with pytest.raises(ValueError, match="is_correction"):
        opd_loss(lp, lp, inf, teacher, mask, is_correction="sequence")
    with pytest.raises(ValueError, match="is_cap"):
        opd_loss(lp, lp, inf, teacher, mask, is_cap=0.0)
    with pytest.raises(ValueError) as e:
        opd_loss(lp, lp, inf, teacher, mask, advantage_baseline="group", advantage_clip=0.0)
    assert "advantage_baseline must be one of" in str(e.value) and "advantage_clip must be > 0" in str(e.value)
