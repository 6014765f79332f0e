"""Environments: a dataset of tasks plus a scoring function.

One interface serves online evals now and GRPO rollouts later: an environment lists
its tasks, turns a task into a chat prompt, and scores a completion with
`reward(completion, task) -> float` (sync or async). Sampling settings and how many
samples to draw per prompt belong to the environment, so an eval and a rollout of the
same task are configured the same way.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_rl.data.sources import open_split


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0


@dataclass
class EvalRun:
    """What an eval of one checkpoint gets: the step (= policy version), its HF checkpoint
    directory, a client of a server already serving exactly those weights, and a place
    for per-sample traces."""

    step: int
    step_dir: Path
    client: Any  # lit_rl.inference.client.InferenceClient
    traces: list[dict] = field(default_factory=list)


class Environment:
    """Subclass and override `load_tasks` and `reward` (and `prompt` if tasks are not
    ``{"prompt": [messages]}``). For an eval that does not fit tasks + reward (say, your
    own scoring of the checkpoint directory), override `evaluate` alone.

    Like scikit-learn estimators, a subclass keeps each constructor argument as an
    attribute of the same name: `to_config` reads them back, so the evaluator process can
    rebuild the same environment from its class path.
    """

    def to_config(self) -> dict:
        """``{"class_path", "init_args"}`` that rebuilds this environment in another process."""
        args: dict = {}
        for cls in type(self).__mro__:
            init = cls.__dict__.get("__init__")
            if init is None:
                continue
            params = list(inspect.signature(init).parameters.values())[1:]
            for p in params:
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in args:
                    if not hasattr(self, p.name):
                        raise TypeError(f"{cls.__name__}.__init__ argument {p.name!r} is not kept as self.{p.name}")
                    args[p.name] = getattr(self, p.name)
            if not any(p.kind == p.VAR_KEYWORD for p in params) or cls is Environment:
                break
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "init_args": args}

    default_name: str | None = None  # subclasses set their metric name here
    default_max_tokens: int = 256

    def __init__(
        self,
        name: str | None = None,
        num_examples: int | None = None,
        samples_per_prompt: int = 1,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = 0,
    ):
        """
        Args:
            name: used in metric names (``eval/<name>/...``); defaults to the class's
                ``default_name``, else the class name.
            num_examples: use only the first N tasks.
            samples_per_prompt: completions drawn per task (pass@k needs k <= this).
            max_tokens: completion length limit; defaults to the class's ``default_max_tokens``.
            temperature, top_p, seed: sampling settings for every request.
        """
        max_tokens = max_tokens or self.default_max_tokens
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if samples_per_prompt > 1 and temperature == 0.0:
            raise ValueError("samples_per_prompt > 1 with temperature 0 draws the same completion every time")
        self.name = name or self.default_name or type(self).__name__
        self.num_examples = num_examples
        self.samples_per_prompt = samples_per_prompt
        self.max_tokens, self.temperature, self.top_p, self.seed = max_tokens, temperature, top_p, seed
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

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        """Sample every task from the served checkpoint, score, and return the metrics
        (mean reward; pass@1 and pass@k with several samples per prompt)."""
        from lit_rl.eval.metrics import task_metrics

        tasks = self.tasks()
        s = self.sampling

        async def one(task: dict) -> list[tuple[str, float]]:
            outs = await run.client.chat(
                self.prompt(task), max_tokens=s.max_tokens, n=self.samples_per_prompt,
                temperature=s.temperature, top_p=s.top_p, seed=s.seed,
            )
            return [(o.text, await self.score(o.text, task)) for o in outs]

        results = await asyncio.gather(*(one(t) for t in tasks))
        metrics = task_metrics(self.samples_per_prompt)
        for task, samples in zip(tasks, results):
            rewards = [r for _, r in samples]
            for name, metric in metrics.items():
                if name == "reward":
                    for r in rewards:
                        metric.update(r)
                else:
                    metric.update(rewards)
            for text, reward in samples:
                run.traces.append({"prompt": self.prompt(task), "completion": text, "reward": reward})
        return {name: float(metric.compute()) for name, metric in metrics.items()}


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

    default_name = "reverse_text"
    default_max_tokens = 64

    def __init__(self, path: str = "examples/reverse_text/data/test.jsonl", **kwargs):
        """
        Args:
            path: a chat dataset (local file or hub name) whose user turns are the texts.
        """
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
