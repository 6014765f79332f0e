"""Replay sources read real dataset files: rows rendered as StaticDataModule renders them, in a
resumable order, bad rows named (or skipped when asked), options checked field by field."""

import pytest

from helpers import TINY_MODEL, reverse_rows, write_jsonl
from lit_rl.data.replay import ReplaySource
from lit_rl.data.sampler import row_order
from lit_rl.data.steps import BadRowError
from lit_rl.errors import ConfigError


def open_stream(source, problems=None):
    problems = [] if problems is None else problems
    stream = source.open(tokenizer=TINY_MODEL, chat_template_kwargs=None, trust_remote_code=False,
                         problems=problems, where="data.replay[0]")
    return stream, problems


def test_rows_come_in_the_seeded_order_and_resume_from_the_position(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", reverse_rows(6))
    stream, problems = open_stream(ReplaySource(path=path, seed=5))
    assert not problems
    first = stream.take(4)
    assert all(s.num_targets > 0 and s.logprobs is None for s in first)  # trained tokens, no sampling logprobs
    state = stream.state_dict()
    rest = stream.take(5)  # crosses into the second pass, which has its own order
    order = row_order(6, 0, shuffle=True, seed=5) + row_order(6, 1, shuffle=True, seed=5)
    assert [s.metadata["row"] for s in first + rest] == order[:9]
    again, _ = open_stream(ReplaySource(path=path, seed=5))
    again.load_state_dict(state)
    assert [s.metadata["row"] for s in again.take(5)] == [s.metadata["row"] for s in rest]


def test_the_order_follows_the_run_seed_and_a_resume_keeps_its_own(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "rows.jsonl", reverse_rows(6))
    rows = lambda samples: [s.metadata["row"] for s in samples]  # noqa: E731
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # what seed_everything(7) sets
    stream, _ = open_stream(ReplaySource(path=path))
    assert rows(stream.take(3)) == row_order(6, 0, shuffle=True, seed=7)[:3] != row_order(6, 0, shuffle=True, seed=8)[:3]
    state = stream.state_dict()
    assert state["seed"] == 7
    monkeypatch.setenv("PL_GLOBAL_SEED", "8")  # a resume launched with another seed
    again, _ = open_stream(ReplaySource(path=path))
    again.load_state_dict(state)
    assert rows(again.take(3)) == row_order(6, 0, shuffle=True, seed=7)[3:]
    legacy, _ = open_stream(ReplaySource(path=path))  # a checkpoint from before the seed was saved: seed 0
    legacy.load_state_dict({"drawn": 3, "skipped": 0})
    assert rows(legacy.take(3)) == row_order(6, 0, shuffle=True, seed=0)[3:]
    explicit, _ = open_stream(ReplaySource(path=path, seed=8))
    with pytest.raises(ValueError, match=r"data.replay\[0\].seed is 8, but .* seed 7"):
        explicit.load_state_dict(state, where="data.replay[0]")


def test_a_resume_with_other_rows_or_shuffle_is_refused_naming_the_source(tmp_path):
    """A replay source's position counts rows of one order: resumed over another number of rows (a
    grown file, another max_examples) or with shuffle switched, it went on from other rows, some
    trained twice and some never, without a word (a StaticDataModule refuses the same)."""
    path = write_jsonl(tmp_path / "rows.jsonl", reverse_rows(6))
    stream, _ = open_stream(ReplaySource(path=path, seed=5))
    stream.take(3)
    state = stream.state_dict()
    grown, _ = open_stream(ReplaySource(path=write_jsonl(tmp_path / "more.jsonl", reverse_rows(8)), seed=5))
    with pytest.raises(ConfigError, match=r"replay source 'replay' .*drew from 6 rows, this one has 8 "
                                          r"\(data.replay\[1\].path, data.replay\[1\].max_examples\)"):
        grown.load_state_dict(state, where="data.replay[1]")
    unshuffled, _ = open_stream(ReplaySource(path=path, seed=5, shuffle=False))
    with pytest.raises(ConfigError, match=r"data.replay\[0\].shuffle True, this one False"):
        unshuffled.load_state_dict(state)
    legacy, _ = open_stream(ReplaySource(path=write_jsonl(tmp_path / "more.jsonl", reverse_rows(8)), seed=5))
    legacy.load_state_dict({"drawn": 3, "skipped": 0, "seed": 5})  # a checkpoint from before: not checked


def test_a_bad_row_is_named_or_skipped_when_asked(tmp_path):
    rows = reverse_rows(4)
    rows[2] = {"messages": [{"role": "user", "content": "no answer"}]}  # nothing to train on
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    stream, _ = open_stream(ReplaySource(path=path, shuffle=False))
    with pytest.raises(BadRowError, match="replay source 'replay': row 2.*bad_rows: skip"):
        stream.take(4)
    stream, _ = open_stream(ReplaySource(path=path, shuffle=False, bad_rows="skip"))
    assert [s.metadata["row"] for s in stream.take(4)] == [0, 1, 3, 0]
    assert stream.skipped == 1


def test_options_are_checked_field_by_field(tmp_path):
    problems = ReplaySource(path="x.jsonl", weight=-1, group_size=4, bad_rows="drop", name="a/b").problems("data.replay[3]")
    text = "\n".join(problems)
    for field in ("data.replay[3].weight", "data.replay[3].group_size is 4", "data.replay[3].bad_rows",
                  "data.replay[3].name"):
        assert field in text, text
    assert ReplaySource(path="x.jsonl", group_size=1).problems("r") == []
    _, problems = open_stream(ReplaySource(path=str(tmp_path / "none.jsonl")))
    assert len(problems) == 1 and "data.replay[0]" in problems[0] and "no such file" in problems[0]


def test_replay_rows_are_groups_of_one_whatever_the_rollouts_group_size(tmp_path):
    """A global group size of 8 stays the rollouts'; the replay source's unit is 1 row, so a
    batch of 10 splits 8 + 2 (with a unit of 8 for the replay rows no split would exist)."""
    from lit_rl.data.replay import ReplayMix

    path = write_jsonl(tmp_path / "rows.jsonl", reverse_rows(6))
    mix = ReplayMix([ReplaySource(path=path, weight=1)], rollout_name="policy", rollout_weight=4)
    problems = []
    mix.open(tokenizer=TINY_MODEL, chat_template_kwargs=None, trust_remote_code=False, rollout_loss="policy_gradient",
             group_size=8, world_size=1, batch_size=10, problems=problems)
    assert not problems
    assert [(part.name, part.unit, count) for part, count in mix.split] == [("policy", 8, 8), ("replay", 1, 2)]
    assert mix.rollout_count(10) == 8 and [len(v) for v in mix.take().values()] == [2]
