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
    # eval sampling settings vLLM would refuse only at the first eval (0 tokens was the default, 256)
    with pytest.raises(ValueError, match=r"Async: max_tokens must be >= 1, got 0; top_p must be in \(0, 1\], got 0"):
        Async(max_tokens=0, top_p=0)
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        Async(temperature=-1)


def test_pass_at_k_by_hand():
    from lit_rl.eval.metrics import PassAtK, pass_at_k

    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    m = PassAtK(2)
    m.update([1.0, 0.0, 0.0, 0.0])
    m.update([1.0, 1.0, 0.5, 0.9])
    assert m.compute().item() == pytest.approx((0.5 + (1 - 1 / 6)) / 2)


def test_arithmetic_env_tasks_reward_and_config():
    from lit_rl.rollouts import ArithmeticEnv

    env = ArithmeticEnv(num_tasks=50, min_value=-5, max_value=12, ops="+-*", task_seed=3)
    tasks = env.tasks()
    assert len(tasks) == 50 and env.name == "arithmetic" and [t["id"] for t in tasks[:2]] == ["0", "1"]
    assert {op for t in tasks for op in "+-*" if f" {op} " in t["prompt"][0]["content"]} == {"+", "-", "*"}
    for t in tasks:  # the stated answer is the question's value
        question = t["prompt"][0]["content"]
        assert question.startswith("What is ") and eval(question[len("What is "):question.index("?")]) == t["answer"]
    t = next(t for t in tasks if t["answer"] < 0)
    score = lambda text: asyncio.run(env.score(text, t))  # noqa: E731
    assert score(f"... so the answer is {t['answer']}.") == 1.0
    assert score(f"{t['answer']} or maybe {t['answer'] + 1}") == 0.0  # the last integer counts
    assert score(f"it is {-t['answer']}") == 0.0 and score("no idea") == 0.0

    config = env.to_config()
    assert config["class_path"] == "lit_rl.rollouts.envs.ArithmeticEnv"
    again = ArithmeticEnv(**config["init_args"])
    assert again.to_config() == config and again.tasks() == tasks
    assert ArithmeticEnv(num_tasks=50, min_value=-5, max_value=12, task_seed=4).tasks() != tasks


def test_arithmetic_env_reports_every_bad_argument():
    from lit_rl.rollouts import ArithmeticEnv

    with pytest.raises(ValueError, match="num_tasks.*min_value.*ops"):
        ArithmeticEnv(num_tasks=0, min_value=3, max_value=1, ops="/")


def test_the_rollout_snippet_in_docs_rl_renders_as_the_example_does():
    """docs/rl.md's episode is examples/tool_use/env.py's, shortened: it must open the transcript
    with the same arguments, the run's chat_template_kwargs among them, or a copy renders its
    prompts unlike the run's other prompts."""
    import ast
    import re

    from helpers import REPO

    def opening_keywords(source: str) -> set[str]:
        (call,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
                   and isinstance(n.func, ast.Attribute) and n.func.attr == "from_messages"]
        return {k.arg for k in call.keywords}

    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", (REPO / "docs/rl.md").read_text(), re.DOTALL)
                  if "Transcript.from_messages" in b]
    example = (REPO / "examples/tool_use/env.py").read_text()
    assert opening_keywords(snippet) == opening_keywords(example) == {"tools", "chat_template_kwargs"}


def test_a_reward_that_is_not_a_finite_number_names_the_env_and_task_in_evals_and_rollouts():
    """A subclass's reward() returning NaN, None or a short score_group list is an error naming
    the environment and the task: torchmetrics' mean would drop a NaN from the eval's reward
    without a word (an eval of rewards 1, NaN, 1 reported 1.0), and a None failed in float()."""
    from pathlib import Path
    from types import SimpleNamespace

    from helpers import TINY_MODEL
    from transformers import AutoTokenizer

    from lit_rl.inference.client import Completion
    from lit_rl.rollouts import RolloutContext, TrainSampling
    from lit_rl.rollouts.envs import EvalRun
    from lit_rl.rollouts.reward_functions import RewardFunctionError

    class Scored(Environment):
        def __init__(self, value, **kwargs):
            super().__init__(**kwargs)
            self.value = value

        def load_tasks(self):
            return [{"id": str(i), "prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]

        def reward(self, completion, task):
            return self.value if task["id"] == "1" else 1.0

    class Client:
        async def chat(self, messages, n=1, **kwargs):
            return [SimpleNamespace(text="a", completion_ids=[1]) for _ in range(n)]

        async def generate(self, prompt_ids, *, n=1, **kwargs):
            return [Completion(prompt_ids=list(prompt_ids), completion_ids=[1], logprobs=[-0.5],
                               finish_reason="stop", text="a") for _ in range(n)]

    run = EvalRun(step=0, step_dir=Path("."), client=Client())
    for value, shown in [(float("nan"), "nan"), (None, "None"), ("1", "'1'")]:
        with pytest.raises(RewardFunctionError, match=f"environment 'my_env': reward\\(\\) on task 1: the reward is {shown};"):
            asyncio.run(Scored(value, name="my_env").evaluate(run))
    assert asyncio.run(Scored(0.0).evaluate(run)) == {"reward": pytest.approx(2 / 3)}  # numbers still pass

    class Short(Scored):
        async def score_group(self, completions, task, completion_ids=None):
            return [1.0] * (len(completions) - 1), {}

    ctx = RolloutContext(client=Client(), tokenizer=AutoTokenizer.from_pretrained(TINY_MODEL),
                         sampling=TrainSampling(max_tokens=4), group_size=4, policy_version=0)
    env = Short(0.0, name="short")
    with pytest.raises(RewardFunctionError, match="environment 'short': score_group on task 0: returned 3 rewards for 4"):
        asyncio.run(env.rollout(env.tasks()[0], ctx))
    with pytest.raises(RewardFunctionError, match="returned 1 rewards for 2 completions"):
        asyncio.run(Short(0.0, samples_per_prompt=2, temperature=1.0).evaluate(run))
