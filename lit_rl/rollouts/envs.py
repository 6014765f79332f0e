"""Environments: a dataset of tasks plus a scoring function.

One interface serves online evals now and GRPO rollouts later: an environment lists
its tasks, turns a task into a chat prompt, and scores a completion with
`reward(completion, task) -> float` (sync or async). Sampling settings and how many
samples to draw per prompt belong to the environment, so an eval and a rollout of the
same task are configured the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

from lit_rl.data.sources import open_split


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0


class Environment:
    """Subclass and override `load_tasks` and `reward` (and `prompt` if tasks are not
    ``{"prompt": [messages]}``)."""

    def __init__(
        self,
        name: str | None = None,
        num_examples: int | None = None,
        samples_per_prompt: int = 1,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = 0,
    ):
        """
        Args:
            name: used in metric names (``eval/<name>/...``); defaults to the class name.
            num_examples: use only the first N tasks.
            samples_per_prompt: completions drawn per task (pass@k needs k <= this).
            max_tokens, temperature, top_p, seed: sampling settings for every request.
        """
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if samples_per_prompt > 1 and temperature == 0.0:
            raise ValueError("samples_per_prompt > 1 with temperature 0 draws the same completion every time")
        self.name = name or type(self).__name__
        self.num_examples = num_examples
        self.samples_per_prompt = samples_per_prompt
        self.sampling = Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        self._tasks: list[dict] | None = None

    def load_tasks(self) -> Sequence[dict]:
        raise NotImplementedError

    def tasks(self) -> list[dict]:
        if self._tasks is None:
            tasks = list(self.load_tasks())
            if self.num_examples is not None:
                tasks = tasks[: self.num_examples]
            if not tasks:
                raise ValueError(f"environment {self.name!r} has no tasks")
            self._tasks = tasks
        return self._tasks

    def prompt(self, task: dict) -> list[dict]:
        """The chat messages sent to the model for this task."""
        return task["prompt"]

    def reward(self, completion: str, task: dict) -> float:
        raise NotImplementedError

    async def score(self, completion: str, task: dict) -> float:
        value = self.reward(completion, task)
        if inspect.isawaitable(value):
            value = await value
        return float(value)


def lcs_ratio(a: str, b: str) -> float:
    """Longest common subsequence of `a` and `b` over the longer length, in [0, 1]."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1] / max(len(a), len(b))


class ReverseTextEnv(Environment):
    """The demo task: reverse the user's text. Reward: LCS ratio against the reversed text."""

    def __init__(self, path: str = "examples/reverse_text/data/test.jsonl", **kwargs):
        kwargs.setdefault("max_tokens", 64)
        kwargs.setdefault("name", "reverse_text")
        super().__init__(**kwargs)
        self.path = path

    def load_tasks(self) -> list[dict]:
        rows = open_split(self.path)
        tasks = []
        for row in rows:
            user = next(m for m in row["messages"] if m["role"] == "user")
            tasks.append({"prompt": [{"role": "user", "content": user["content"]}], "text": user["content"]})
        return tasks

    def reward(self, completion: str, task: dict) -> float:
        return lcs_ratio(completion.strip(), task["text"][::-1])
