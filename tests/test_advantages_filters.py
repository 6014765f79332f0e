"""Group-relative advantages and rollout filters against hand-computed numbers (pure, no server)."""

from __future__ import annotations

import math

import pytest

from lit_rl.data.samples import Sample
from lit_rl.rollouts.advantages import all_equal, group_advantages, std, with_group_advantages
from lit_rl.rollouts.filters import GibberishFilter, RepetitionFilter, apply_filters, default_filters


def sample(completion: list[int], reward: float = 0.0, logprobs: list[float] | None = None, prompt=(7, 8)) -> Sample:
    n = len(prompt)
    return Sample(
        input_ids=[*prompt, *completion], loss_mask=[False] * n + [True] * len(completion),
        logprobs=None if logprobs is None else [0.0] * n + list(logprobs), reward=reward, source="policy",
    )


# -- advantages ---------------------------------------------------------------------------


def test_group_scale_divides_by_each_groups_population_std():
    # [1,0,1,0]: mean .5, std .5 -> +-1;  [3,1]: mean 2, std 1 -> +-1;  [0,.5,1]: std sqrt(1/6)
    out = group_advantages([[1, 0, 1, 0], [3, 1], [0, 0.5, 1]], scale="group", eps=0.0)
    assert out[0] == [1.0, -1.0, 1.0, -1.0]
    assert out[1] == [1.0, -1.0]
    assert out[2] == pytest.approx([-1.2247449, 0.0, 1.2247449], abs=1e-7)
    # the default eps is in the divisor: 0.5 / (0.5 + 1e-6)
    assert group_advantages([[1, 0]])[0] == pytest.approx([0.999998, -0.999998], abs=1e-9)


def test_batch_scale_divides_by_the_std_of_all_rewards_in_the_batch():
    # batch rewards [1,0,1,1]: mean .75, var (.0625+.5625+.0625+.0625)/4 = .1875, std .4330127
    out = group_advantages([[1, 0], [1, 1]], scale="batch", eps=0.0)
    assert out[0] == pytest.approx([1.1547005, -1.1547005], abs=1e-7)
    assert out[1] == [0.0, 0.0]


def test_none_scale_only_centres():
    assert group_advantages([[3, 1], [2, 2], [0.25, 0.75, 0.5]], scale="none") == [[1.0, -1.0], [0.0, 0.0], [-0.25, 0.25, 0.0]]


def test_equal_rewards_and_tiny_stds_are_guarded():
    # equal rewards give exactly 0 (the float mean of [0.1]*3 is not exactly 0.1), a group of one too
    assert group_advantages([[0.1, 0.1, 0.1], [5.0]], scale="group") == [[0.0, 0.0, 0.0], [0.0]]
    assert all_equal([0.1, 0.1, 0.1]) and not all_equal([0.1, 0.1, 0.2])
    # a near-tie is not blown up to +-1 by a 1e-9 std: 5e-10 / (5e-10 + 1e-6)
    tiny = group_advantages([[1e-9, 0.0]], scale="group", eps=1e-6)[0]
    assert tiny == pytest.approx([4.995e-4, -4.995e-4], rel=1e-3)
    assert std([2.0]) == 0.0 and std([1.0, 3.0]) == 1.0
    with pytest.raises(ValueError, match="scale must be one of"):
        group_advantages([[1, 0]], scale="rank")


def test_advantages_fill_the_loss_mask_tokens_and_sum_to_zero_per_group():
    batch = [sample([1, 2], reward=1.0), sample([3], reward=0.0), sample([4, 5, 6], reward=2.0), sample([7], reward=2.0)]
    out = with_group_advantages(batch, group_size=2, scale="none")
    assert [s.advantages for s in out] == [[0, 0, 0.5, 0.5], [0, 0, -0.5], [0, 0, 0, 0, 0], [0, 0, 0]]
    assert all(a.input_ids == b.input_ids and a.loss_mask == b.loss_mask for a, b in zip(out, batch))
    assert batch[0].advantages is None  # copies: the inputs are untouched
    for g in range(0, 4, 2):
        assert math.fsum(next(a for a, m in zip(s.advantages, s.loss_mask) if m) for s in out[g:g + 2]) == 0.0
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        with_group_advantages(batch, group_size=3)
    with pytest.raises(ValueError, match="have no reward"):
        with_group_advantages([sample([1]), Sample([1, 2], [False, True])], group_size=2)


# -- filters ------------------------------------------------------------------------------


def test_gibberish_needs_a_run_of_low_logprob_completion_tokens():
    lps = [-10.0, -12.0, -9.5, -1.0, -11.0, -10.0]  # longest run below -9: 3 tokens
    assert GibberishFilter(threshold=-9.0, run=3).check(sample([1, 2, 3, 4, 5, 6], logprobs=lps))
    assert not GibberishFilter(threshold=-9.0, run=4).check(sample([1, 2, 3, 4, 5, 6], logprobs=lps))
    assert not GibberishFilter(threshold=-12.5, run=1).check(sample([1, 2, 3, 4, 5, 6], logprobs=lps))
    # context tokens never count, even with a logprob below the threshold (logprobs are 0 there anyway)
    s = Sample(input_ids=[1, 2, 3, 4], loss_mask=[False, False, True, True], logprobs=[-20.0, -20.0, -20.0, -1.0])
    assert not GibberishFilter(threshold=-9.0, run=2).check(s)
    # no sampling logprobs (a static row): exempt
    assert not GibberishFilter(threshold=0.0, run=1).check(sample([1, 2, 3]))


def test_repetition_counts_overlapping_ngrams_of_completion_ids_only():
    loop = [1, 2, 3, 1, 2, 3, 1, 2, 3]  # (1,2,3) at 0, 3, 6
    assert RepetitionFilter(ngram=3, min_count=3).check(sample(loop))
    assert not RepetitionFilter(ngram=3, min_count=4).check(sample(loop))
    assert RepetitionFilter(ngram=2, min_count=5).check(sample([5] * 6))  # (5,5) five times, overlapping
    assert not RepetitionFilter(ngram=2, min_count=6).check(sample([5] * 6))
    # repetition in the prompt is not the model's doing
    assert not RepetitionFilter(ngram=2, min_count=2).check(sample([1, 2, 3], prompt=(9, 9, 9, 9, 9)))
    assert not RepetitionFilter(ngram=16, min_count=4).check(sample(list(range(100))))


def test_filters_always_measure_and_zero_the_loss_only_when_enforced():
    gibberish = sample([1, 2, 3], reward=0.5, logprobs=[-20.0, -20.0, -20.0])
    looping = sample([4, 4, 4, 4], reward=1.0, logprobs=[-0.1] * 4)
    fine = sample([5, 6], reward=0.0, logprobs=[-0.1, -0.2])
    filters = [GibberishFilter(threshold=-9.0, run=3, enforce=True), RepetitionFilter(ngram=1, min_count=3)]
    result = apply_filters([gibberish, looping, fine], filters)
    assert result.flagged == {"gibberish": 1, "repetition": 1} and result.enforced == 1
    g, r, f = result.samples
    assert g.loss_mask == [False] * 5 and g.metadata == {"flags": ["gibberish"], "filtered": "gibberish"}
    assert g.reward == 0.5 and g.input_ids == gibberish.input_ids  # stays in its group, trains nothing
    assert r.loss_mask == looping.loss_mask and r.metadata == {"flags": ["repetition"]}  # measured only
    assert f is fine
    assert gibberish.loss_mask != g.loss_mask  # inputs untouched


def test_filter_settings_are_checked_and_defaults_only_measure():
    with pytest.raises(ValueError, match="run must be an int >= 1"):
        GibberishFilter(run=0)
    with pytest.raises(ValueError, match="ngram must be an int >= 1.*min_count must be an int >= 2"):
        RepetitionFilter(ngram=0, min_count=1)
    assert [f.name for f in default_filters()] == ["gibberish", "repetition"]
    assert not any(f.enforce for f in default_filters())
