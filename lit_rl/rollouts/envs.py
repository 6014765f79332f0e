"""Environments: a dataset of tasks plus a scoring function.

One interface serves online evals and GRPO rollouts: an environment lists its tasks, turns
a task into a chat prompt, and scores a completion with `reward(completion, task) -> float`
(sync or async). `evaluate` samples with the environment's own (eval) `Sampling`;
`rollout(task, ctx)` samples a group for training with the trainer's `TrainSampling` from
the context, and a multi-turn environment overrides it using `lit_rl.rollouts.turns`.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_rl.data.samples import SampleGroup
from lit_rl.data.sources import open_split
from lit_rl.inference.client import chat_prompt_ids
from lit_rl.rollouts.context import RolloutContext, sampling_problems
from lit_rl.rollouts.reward_functions import RewardFunctionError, is_finite_number, plain_number, value_list
from lit_rl.rollouts.turns import completion_sample, completion_text


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
    chat_template_kwargs: dict = field(default_factory=dict)  # the training data's (EvalPlan): render prompts with them


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
        max_tokens = self.default_max_tokens if max_tokens is None else max_tokens
        if problems := sampling_problems(max_tokens, temperature, top_p, None):  # vLLM refuses them only at the first eval
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
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

    def tasks_problem(self) -> str | None:
        """Why the tasks cannot be read (a missing file, column or row), or None; they are read
        now and kept, so that a run or an eval says so before any server starts. An environment
        without `load_tasks` of its own (a custom `evaluate` that needs no tasks) has none to read."""
        if type(self).load_tasks is Environment.load_tasks:
            return None
        try:
            self.tasks()
        except (ValueError, KeyError, FileNotFoundError, ImportError) as e:
            return str(e)
        return None

    def prompt(self, task: dict) -> list[dict]:
        """The chat messages sent to the model for this task."""
        return task["prompt"]

    def tools(self, task: dict) -> list[dict] | None:
        """Tool definitions rendered into this task's prompt during rollouts (None: no tools)."""
        return None

    def task_id(self, task: dict) -> str | None:
        """A stable id for traces and groups: the task's ``"id"``, if it has one."""
        value = task.get("id")
        return None if value is None else str(value)

    def reward(self, completion: str, task: dict) -> float:
        raise NotImplementedError

    async def score(self, completion: str, task: dict) -> float:
        value = self.reward(completion, task)
        if inspect.isawaitable(value):
            value = await value
        return _finite(value, f"environment {self.name!r}: reward() on task {self.task_id(task)}")

    async def score_group(self, completions: list[str], task: dict, completion_ids: list[list[int]] | None = None
                          ) -> tuple[list[float], dict[str, list[float | None]]]:
        """Every completion of one task scored at once: the rewards, and named parts of them that
        are logged apart (``train/reward/<name>``, ``eval/<env>/reward/<name>``; None where a part
        does not apply). Rollouts and evals both score through here. Default: `score` each, no
        parts; `DatasetEnv` sums its reward functions here."""
        return list(await asyncio.gather(*(self.score(text, task) for text in completions))), {}

    async def rollout(self, task: dict, ctx: RolloutContext) -> SampleGroup:
        """Training samples for one task: `ctx.group_size` single-turn completions of its prompt.

        Each sample is prompt ids + the completion's exact ids and logprobs (see
        `completion_sample`), rewarded on the text decoded here from those ids. The buffer, not
        the environment, fills `advantages` and `policy_version`. Override for multi-turn tasks.
        """
        prompt_ids = chat_prompt_ids(ctx.tokenizer, self.prompt(task), self.tools(task), ctx.chat_template_kwargs)
        outs = await ctx.client.generate(prompt_ids, n=ctx.group_size, **ctx.sampling.request_kwargs())
        texts = [completion_text(ctx.tokenizer, c) for c in outs]
        rewards, parts = await self.score_group(texts, task, [c.completion_ids for c in outs])
        rewards = self.checked_rewards(rewards, len(texts), task)
        task_id = self.task_id(task)
        samples = [
            completion_sample(prompt_ids, c, reward=r,
                              metadata={"task_id": task_id, "completion": text, **parts_of(parts, i)})
            for i, (c, text, r) in enumerate(zip(outs, texts, rewards))
        ]
        return SampleGroup(samples=samples, task_id=task_id)

    def checked_rewards(self, rewards, n: int, task: dict) -> list[float]:
        """`score_group`'s rewards for `n` completions, checked: one finite number each, else a
        `RewardFunctionError` naming the environment and the task (a NaN would otherwise be
        dropped from an eval's mean without a word, and a short list would drop completions)."""
        where = f"environment {self.name!r}: score_group on task {self.task_id(task)}"
        if (listed := value_list(rewards)) is None:
            raise RewardFunctionError(f"{where}: returned {type(rewards).__name__}; expected {n} rewards")
        if len(listed) != n:
            raise RewardFunctionError(f"{where}: returned {len(listed)} rewards for {n} completions")
        return [_finite(r, f"{where}, completion {i}") for i, r in enumerate(listed)]

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        """Sample every task from the served checkpoint, score, and return the metrics
        (mean reward; pass@1 and pass@k with several samples per prompt)."""
        tasks = self.tasks()
        s = self.sampling

        async def one(task: dict):
            outs = await run.client.chat(
                self.prompt(task), tools=self.tools(task), chat_template_kwargs=run.chat_template_kwargs or None,
                max_tokens=s.max_tokens, n=self.samples_per_prompt, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
            )
            texts = [o.text for o in outs]
            rewards, parts = await self.score_group(texts, task, [o.completion_ids for o in outs])
            return texts, self.checked_rewards(rewards, len(texts), task), parts

        results = await asyncio.gather(*(one(t) for t in tasks))
        for task, (texts, rewards, parts) in zip(tasks, results):
            for i, (text, reward) in enumerate(zip(texts, rewards)):
                run.traces.append({"prompt": self.prompt(task), "completion": text, "reward": reward, **parts_of(parts, i)})
        return eval_metrics([(rewards, parts) for _, rewards, parts in results], self.samples_per_prompt)


def _finite(value: Any, where: str) -> float:
    """`value` as a float when it is a finite real number (a 0-d array or tensor too), else a
    `RewardFunctionError` saying `where`."""
    value = plain_number(value)
    if is_finite_number(value):
        return float(value)
    raise RewardFunctionError(f"{where}: the reward is {value!r:.80}; expected a finite number")


def eval_metrics(scored: list[tuple[list[float], dict[str, list[float | None]]]], samples_per_prompt: int) -> dict[str, float]:
    """An eval's metrics from each task's rewards and named parts (`score_group`'s two results):
    mean reward (pass@1, pass@k with several samples per task) and each part's mean."""
    from lit_rl.eval.metrics import task_metrics

    metrics = task_metrics(samples_per_prompt)
    part_values: dict[str, list[float]] = {}
    for rewards, parts in scored:
        for name, metric in metrics.items():
            if name == "reward":
                for r in rewards:
                    metric.update(r)
            else:
                metric.update(rewards)
        for name, values in parts.items():
            part_values.setdefault(name, []).extend(v for v in values if v is not None)
    out = {name: float(metric.compute()) for name, metric in metrics.items()}
    out.update({f"reward/{name}": sum(v) / len(v) for name, v in part_values.items() if v})
    return out


def parts_of(parts: dict[str, list[float | None]], i: int) -> dict:
    """``{"rewards": {name: value}}`` of completion i, for its sample's metadata or eval trace; ``{}``
    when the environment reports no named parts."""
    return {"rewards": {name: values[i] for name, values in parts.items()}} if parts else {}


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
        if "messages" not in rows.column_names:
            raise ValueError(f"ReverseTextEnv: {self.path} has no 'messages' column (columns: {rows.column_names}); "
                             "it reads chat rows and reverses each one's first user turn")
        tasks = []
        for i, messages in enumerate(rows["messages"]):
            user = next((m for m in messages or [] if isinstance(m, dict) and m.get("role") == "user"), None)
            if user is None or not isinstance(user.get("content"), str):
                raise ValueError(f"ReverseTextEnv: row {i} of {self.path} has no user turn with text content: "
                                 f"{messages!r:.200}")
            tasks.append({"id": str(i), "prompt": [{"role": "user", "content": user["content"]}], "text": user["content"]})
        return tasks

    def reward(self, completion: str, task: dict) -> float:
        return lcs_ratio(completion.strip(), task["text"][::-1])


class PromptsEnv(Environment):
    """Prompts from a dataset and no reward: what a teacher answers for SFT (`data.source:
    teacher`). Each row's `column` is a string (one user message), a list of chat messages, or
    a `messages` conversation whose trailing assistant turns are dropped (the teacher writes
    its own). The reward is 0 for every completion."""

    default_name = "prompts"

    def __init__(self, path: str, column: str = "prompt", split: str = "train", **kwargs):
        """
        Args:
            path: a local json/jsonl/parquet/csv file, a saved dataset or a hub name.
            column: the column holding each row's prompt (a string or chat messages).
            split: the split, for hub datasets and saved dataset dictionaries.
        """
        super().__init__(**kwargs)
        self.path, self.column, self.split = path, column, split

    def load_tasks(self) -> list[dict]:
        rows = open_split(self.path, split=self.split)
        if self.column not in rows.column_names:
            raise ValueError(f"PromptsEnv: {self.path} has no column {self.column!r} (columns: {rows.column_names})")
        tasks = []
        for i, value in enumerate(rows[self.column]):
            if isinstance(value, str):
                messages = [{"role": "user", "content": value}]
            elif isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
                messages = list(value)
                while messages and messages[-1]["role"] == "assistant":
                    messages.pop()
            else:
                messages = []
            if not messages:
                raise ValueError(f"PromptsEnv: row {i} of {self.path}, column {self.column!r}: expected a string or "
                                 f"chat messages ending before an answer, got {value!r:.200}")
            tasks.append({"id": str(i), "prompt": messages})
        return tasks

    def reward(self, completion: str, task: dict) -> float:
        return 0.0


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INT = re.compile(r"-?\d+")


class ArithmeticEnv(Environment):
    """A verifiable task that needs no data: "What is 17 + 25?" over small integers.

    Tasks are drawn from `task_seed`, so every process (trainer, evaluator) lists the same ones.
    Reward: 1.0 if the last integer in the completion equals the answer, else 0.0.
    """

    default_name = "arithmetic"
    default_max_tokens = 32

    def __init__(self, num_tasks: int = 1000, min_value: int = 0, max_value: int = 20, ops: str = "+-*",
                 task_seed: int = 0, **kwargs):
        """
        Args:
            num_tasks: how many tasks to generate.
            min_value, max_value: operands are drawn uniformly from [min_value, max_value].
            ops: the operators to draw from, any of "+", "-", "*".
            task_seed: seed of the task generator (``seed`` is the eval sampling seed).
        """
        problems = []
        if num_tasks < 1:
            problems.append(f"num_tasks must be >= 1, got {num_tasks}")
        if min_value > max_value:
            problems.append(f"min_value ({min_value}) must be <= max_value ({max_value})")
        if not ops or set(ops) - set(_OPS):
            problems.append(f"ops must be a non-empty string of {''.join(_OPS)!r}, got {ops!r}")
        if problems:
            raise ValueError("ArithmeticEnv: " + "; ".join(problems))
        super().__init__(**kwargs)
        self.num_tasks, self.min_value, self.max_value = num_tasks, min_value, max_value
        self.ops, self.task_seed = ops, task_seed

    def load_tasks(self) -> list[dict]:
        rng = random.Random(self.task_seed)
        tasks = []
        for i in range(self.num_tasks):
            a, b = rng.randint(self.min_value, self.max_value), rng.randint(self.min_value, self.max_value)
            op = rng.choice(self.ops)
            question = f"What is {a} {op} {b if b >= 0 else f'({b})'}? End your answer with the result as an integer."
            tasks.append({"id": str(i), "prompt": [{"role": "user", "content": question}], "answer": _OPS[op](a, b)})
        return tasks

    def reward(self, completion: str, task: dict) -> float:
        numbers = _INT.findall(completion)
        return 1.0 if numbers and int(numbers[-1]) == task["answer"] else 0.0
