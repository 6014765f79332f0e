"""Losses against numbers worked out by hand."""

import math

import torch

from lit_rl.losses import masked_cross_entropy_sum, shifted_token_logprobs


def test_masked_cross_entropy_sum_matches_hand_computation():
    # one row, 3 tokens, vocabulary of 2; logits at positions 0 and 1 predict tokens 1 and 2.
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [5.0, 5.0]]])
    input_ids = torch.tensor([[0, 1, 0]])
    # token 1 (id 1) from logits[0]=[0,0]: -log(1/2); token 2 (id 0) from logits[1]=[2,0]: -log(e^2/(e^2+1))
    ce1 = math.log(2.0)
    ce2 = -math.log(math.exp(2) / (math.exp(2) + 1))
    both = torch.tensor([[False, True, True]])
    assert masked_cross_entropy_sum(logits, input_ids, both).item() == pytest_approx(ce1 + ce2)
    only_last = torch.tensor([[True, False, True]])  # mask on token 0 is ignored: nothing predicts it
    assert masked_cross_entropy_sum(logits, input_ids, only_last).item() == pytest_approx(ce2)
    assert masked_cross_entropy_sum(logits, input_ids, torch.zeros(1, 3, dtype=torch.bool)).item() == 0.0


def test_shifted_token_logprobs_aligned_with_tokens():
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [5.0, 5.0]]])
    input_ids = torch.tensor([[0, 1, 0]])
    lp = shifted_token_logprobs(logits, input_ids)
    expected = [0.0, -math.log(2.0), math.log(math.exp(2) / (math.exp(2) + 1))]
    assert lp.shape == (1, 3)
    for got, want in zip(lp[0].tolist(), expected):
        assert got == pytest_approx(want)


def pytest_approx(x):
    import pytest

    return pytest.approx(x, abs=1e-6)
