"""Environments: the LCS reward against hand-worked values, tasks from a real file."""

import asyncio

import pytest

from lit_rl.rollouts.envs import Environment, ReverseTextEnv, lcs_ratio
from helpers import reverse_rows, write_jsonl


@pytest.mark.parametrize(
    "a,b,want",
    [("abc", "abc", 1.0), ("abc", "", 0.0), ("", "", 1.0), ("abcd", "acbd", 3 / 4), ("olleh", "hello", 2 / 5),
     ("xaxbxc", "abc", 3 / 6), ("dlrow", "dlrow olleh", 5 / 11)],
)
def test_lcs_ratio(a, b, want):
    assert lcs_ratio(a, b) == pytest.approx(want)


def test_reverse_text_env_tasks_and_reward(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", reverse_rows(5))
    env = ReverseTextEnv(path, num_examples=3)
    tasks = env.tasks()
    assert len(tasks) == 3 and env.name == "reverse_text"
    text = tasks[0]["text"]
    assert env.prompt(tasks[0]) == [{"role": "user", "content": text}]
    assert asyncio.run(env.score(" " + text[::-1] + "\n", tasks[0])) == 1.0
    assert asyncio.run(env.score(text, tasks[0])) < 1.0


def test_async_reward_and_bad_settings():
    class Async(Environment):
        def load_tasks(self):
            return [{"prompt": [{"role": "user", "content": "x"}]}]

        async def reward(self, completion, task):
            return 0.25

    env = Async()
    assert asyncio.run(env.score("y", env.tasks()[0])) == 0.25
    with pytest.raises(ValueError, match="same completion"):
        Async(samples_per_prompt=4)


def test_pass_at_k_by_hand():
    from lit_rl.eval.metrics import PassAtK, pass_at_k

    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    m = PassAtK(2)
    m.update([1.0, 0.0, 0.0, 0.0])
    m.update([1.0, 1.0, 0.5, 0.9])
    assert m.compute().item() == pytest.approx((0.5 + (1 - 1 / 6)) / 2)
