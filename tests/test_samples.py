"""Sample: per-token fields are checked against input_ids; static rows say they have no sampling logprobs."""

import pytest

from lit_rl.data.samples import Sample


def test_static_defaults():
    s = Sample(input_ids=[1, 2, 3], loss_mask=[False, True, True])
    assert not s.has_sampling_logprobs and s.logprobs is None
    assert (s.advantages, s.teacher_logprobs, s.policy_version, s.reward, s.finish_reason) == (None,) * 5
    assert s.source == "static" and s.metadata == {} and not s.truncated
    assert Sample(input_ids=[1], loss_mask=[True]).metadata is not s.metadata  # no shared default dict


@pytest.mark.parametrize("name", ["loss_mask", "logprobs", "advantages", "teacher_logprobs"])
def test_per_token_field_of_wrong_length_is_refused(name):
    fields = {"input_ids": [1, 2, 3, 4], "loss_mask": [False, True, True, True]}
    fields[name] = [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=rf"input_ids has 4 tokens but {name} has 3"):
        Sample(**fields)
    fields[name] = [0.0] * 4 if name != "loss_mask" else [False, True, True, True]
    Sample(**fields)  # right length: fine


def test_every_length_problem_in_one_error():
    with pytest.raises(ValueError) as err:
        Sample(input_ids=[1, 2], loss_mask=[True, True], logprobs=[0.0], teacher_logprobs=[0.0, 0.0, 0.0])
    assert "logprobs has 1" in str(err.value) and "teacher_logprobs has 3" in str(err.value)


def test_rollout_sample_and_with_advantage():
    s = Sample(
        input_ids=[5, 6, 7, 8],
        loss_mask=[False, False, True, True],
        logprobs=[0.0, 0.0, -0.5, -1.5],
        policy_version=2,
        reward=1.0,
        source="policy",
        finish_reason="length",
        metadata={"task": "t1"},
    )
    assert s.has_sampling_logprobs
    g = s.with_advantage(0.75)
    assert g.advantages == [0.0, 0.0, 0.75, 0.75]
    assert s.advantages is None  # a copy: the original is unchanged
    assert (g.logprobs, g.policy_version, g.reward, g.source, g.finish_reason) == (s.logprobs, 2, 1.0, "policy", "length")
    assert g.metadata == s.metadata and g.metadata is not s.metadata
