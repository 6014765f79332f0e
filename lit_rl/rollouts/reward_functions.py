"""Reward functions named in a config: resolved by import path, called over one task's group.

Two signatures are accepted, told apart by their parameter names:

- **TRL's** (``completions`` among the parameters): ``fn(prompts, completions, **columns) ->
  list[float | None]``, called once per group with one entry per completion. ``prompts`` and
  ``completions`` are chat messages when the dataset's prompts are messages (TRL's
  "conversational" format: a completion is ``[{"role": "assistant", "content": text}]``) and
  strings when they are strings; every column of the row comes as a list, as do
  ``completion_ids`` (the sampled token ids) and ``task_ids``; and, as TRL hands them,
  ``trainer_state`` (`RewardState`: ``global_step``), ``log_metric(name, value)`` and
  ``log_extra(column, values)`` (`RewardLog`). A function without ``**kwargs`` gets only the
  arguments it names. It returns a list (or an array: numpy's, torch's) with one value per
  completion; ``None`` means "does not apply to this completion": it adds nothing to the weighted
  sum and is left out of that reward's mean.
- **lit-rl's per-sample form** (``completion`` among the parameters): ``fn(completion, task) ->
  float``, as `Environment.reward`, with ``task["row"]`` the dataset row.

Either may be ``async``. A sync function runs on the rollout loop, as TRL runs its reward
functions in its training loop: make a slow one async, or hand its work to a pool as
`lit_rl.rewards.math_verify` does. Keyword arguments in the config are bound first
(`functools.partial`), which is how the built-in rewards are told their column.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_rl.rewards.extras import require

#: what a TRL-form function gets besides the dataset's columns; a parameter with one of these
#: names is never taken for a column
PROVIDED = ("prompts", "completions", "completion_ids", "task_ids", "trainer_state", "log_extra", "log_metric")


class RewardFunctionError(ValueError):
    """A reward function raised or returned something unusable for one group (retried, then the
    task rejected, under the rollout buffer's rules)."""


@dataclass(frozen=True)
class RewardState:
    """What a TRL-form function gets as ``trainer_state`` (TRL hands its `TrainerState`, for
    rewards shaped by training's progress): ``global_step`` is the optimizer steps the weights
    that sampled the group had taken (its policy version); in an eval, the checkpoint's step.
    TRL's `max_steps` and `epoch` are absent: the rollouts and the evaluator are not told the
    trainer's `max_steps` (a reward that needs it takes it as a bound keyword argument)."""

    global_step: int = 0


@dataclass
class RewardLog:
    """What TRL-form functions log while scoring one group, through the ``log_metric`` and
    ``log_extra`` they are handed. A rollout's samples carry it (``metadata["reward_metrics"]``,
    logged as ``train/reward_metric/<name>``, the mean over the step's samples;
    ``metadata["extra"]``, written with each sample to ``rollouts/trained.jsonl``, TRL's
    completions table); an eval logs the metrics as ``eval/<env>/reward_metric/<name>``."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        value = plain_number(value)
        if not isinstance(name, str) or not is_finite_number(value):
            raise RewardFunctionError(f"log_metric({name!r}, {value!r}): expected a metric name and a finite number")
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: Sequence) -> None:
        if not isinstance(column, str):
            raise RewardFunctionError(f"log_extra({column!r}, ...): the column must be a name")
        self.extra[column] = list(values.tolist() if hasattr(values, "tolist") else values)

    def metric_means(self) -> dict[str, float]:
        return {name: sum(values) / len(values) for name, values in self.metrics.items()}

    def extra_of(self, n: int, row: Any) -> list[dict]:
        """Each completion's logged columns, checked: one value per completion, JSON-serialisable."""
        import json

        for column, values in self.extra.items():
            if len(values) != n:
                raise RewardFunctionError(f"row {row}: log_extra({column!r}, ...) got {len(values)} values for {n} "
                                          "completions; log one per completion")
            try:
                json.dumps(values)
            except (TypeError, ValueError) as e:
                raise RewardFunctionError(f"row {row}: log_extra({column!r}, ...): values must be JSON "
                                          f"(numbers, strings, lists, dicts): {e}") from None
        return [{column: values[i] for column, values in self.extra.items()} for i in range(n)]


def import_callable(path: str, what: str) -> Callable:
    """`module.attr` (or `module:attr`) by import path, with one message naming `what` when it fails."""
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ValueError(f"{what}: {path!r} is not an import path (write module.function)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import module {module_name!r} for {path!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what}: {module_name!r} has no callable {attr!r}")
    return fn


def builtin_options(fn: Callable) -> list[str]:
    """The keyword options of one of lit-rl's built-in rewards (`lit_rl.rewards`), beside what it is
    called with; [] for any other function."""
    if not getattr(fn, "__module__", "").startswith("lit_rl.rewards"):
        return []
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.name not in PROVIDED and p.name != "prompts"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def unknown_builtin_options(fn: Callable, kwargs: dict) -> list[str]:
    """`kwargs` that a built-in reward does not name: its `**columns` would take them as columns and
    drop them (``answer_colum: solution`` scored against `answer`). A function of the user's may read any
    keyword from its ``**kwargs``, so only built-ins are checked."""
    options = builtin_options(fn)
    return [k for k in kwargs if k not in options] if options else []


class RewardFunction:
    """One configured reward: its callable, weight, name and form."""

    def __init__(self, function: str | Callable, weight: float = 1.0, name: str | None = None,
                 kwargs: dict | None = None, where: str = "rewards"):
        """
        Args:
            function: import path (``my_rewards.correct``, ``lit_rl.rewards.math_verify``) or a callable.
            weight: its weight in the sum that is the sample's reward.
            name: the metric's name (``train/reward/<name>``); default: the function's name.
            kwargs: keyword arguments bound to it (a built-in's column, a pattern, a timeout).
            where: the config location, for messages.
        """
        fn = import_callable(function, where) if isinstance(function, str) else function
        if getattr(fn, "requires", None):  # a built-in over an optional package: say which extra, now
            require(fn.requires, f"{where}: {function}")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight):
            raise ValueError(f"{where}: weight must be a finite number, got {weight!r}")
        self.kwargs = dict(kwargs or {})
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        if unknown := unknown_builtin_options(fn, self.kwargs):  # a built-in's **columns took a misspelt option silently
            raise ValueError(f"{where}: {self.name} has no option {', '.join(map(repr, unknown))}; its options are "
                             f"{', '.join(builtin_options(fn))}")
        self.fn = functools.partial(fn, **self.kwargs) if self.kwargs else fn
        self.weight, self.where = float(weight), where
        try:
            params = inspect.signature(self.fn).parameters
        except ValueError as e:  # functools' "partial object ... has incorrect arguments"
            raise ValueError(f"{where}: kwargs {sorted(self.kwargs)} do not fit {self.name}'s arguments ({e})") from None
        self.takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.params = set(params)
        if "completions" in params:
            self.form = "trl"
        elif "completion" in params:
            self.form = "sample"
            try:  # called so for every completion: a mismatch said now, not by every call once the servers are up
                inspect.signature(self.fn).bind(completion=None, task=None)
            except TypeError as e:
                raise ValueError(f"{where}: {self.name} takes ({', '.join(params)}); lit-rl's per-sample form is "
                                 f"called as fn(completion=..., task=...) ({e})") from None
        else:
            raise ValueError(f"{where}: {self.name} takes ({', '.join(params)}); a reward function takes "
                             "(prompts, completions, **columns) as TRL's do, or (completion, task)")
        declared = getattr(fn, "required_columns", None)  # built-ins name the columns their kwargs point at
        if callable(declared):
            try:
                self.columns = list(declared(**self.kwargs))
            except TypeError as e:  # a required option missing: said with the entry, not as a traceback
                raise ValueError(f"{where}: {self.name}: {e}") from None
        elif self.form == "trl":
            self.columns = [p.name for p in params.values() if p.name not in PROVIDED and p.default is p.empty
                            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        else:
            self.columns = []

    async def __call__(self, prompts: list, completions: list, columns: dict[str, list], tasks: list[dict],
                       completion_ids: list[list[int]] | None, row: Any, state: RewardState | None = None,
                       log: RewardLog | None = None) -> list[float | None]:
        """The function's value for each completion of one task's group, checked: one finite
        number (or None) per completion, else a `RewardFunctionError` naming it and the row."""
        try:
            if self.form == "trl":
                log = log if log is not None else RewardLog()
                given = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                         "task_ids": [t.get("id") for t in tasks], "trainer_state": state or RewardState(),
                         "log_metric": log.log_metric, "log_extra": log.log_extra, **columns}
                value = self.fn(**(given if self.takes_any else {k: v for k, v in given.items() if k in self.params}))
                if inspect.isawaitable(value):
                    value = await value
                values = value
            else:  # an async one (an LLM judge, say) scores the group's completions concurrently
                values = [self.fn(completion=completion, task=task) for completion, task in zip(completions, tasks)]
                pending = [i for i, v in enumerate(values) if inspect.isawaitable(v)]
                for i, v in zip(pending, await asyncio.gather(*(values[i] for i in pending))):
                    values[i] = v
        except RewardFunctionError:
            raise
        except Exception as e:
            raise RewardFunctionError(f"reward function {self.name!r} raised on row {row}: {e!r}") from e
        return self.check(values, len(completions), row)

    def check(self, values: Any, n: int, row: Any) -> list[float | None]:
        if (listed := value_list(values)) is None:
            raise RewardFunctionError(f"reward function {self.name!r} on row {row}: returned {type(values).__name__}; "
                                      f"expected a list of {n} numbers (one per completion)")
        if len(listed) != n:
            raise RewardFunctionError(f"reward function {self.name!r} on row {row}: returned {len(listed)} values "
                                      f"for {n} completions")
        out: list[float | None] = []
        for i, v in enumerate(listed):
            v = plain_number(v)
            if v is not None and not is_finite_number(v):
                raise RewardFunctionError(f"reward function {self.name!r} on row {row}: value {i} is {v!r}; "
                                          "expected a finite number or None")
            out.append(None if v is None else float(v))
        return out


def plain_number(value: Any) -> Any:
    """A 0-d array or tensor as the Python number it holds; anything else as it is."""
    return value.item() if hasattr(value, "item") and not isinstance(value, numbers.Real) else value


def is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


def value_list(values: Any) -> list | None:
    """Rewards returned for a group, as a list (an array too: numpy's or torch's, as TRL takes them);
    None when they are not a sequence (a number, a string, a dict)."""
    if hasattr(values, "tolist") and not isinstance(values, Sequence):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        return None
    return list(values)


def weighted_sum(parts: dict[str, list[float | None]], weights: dict[str, float], row: Any) -> list[float]:
    """Each completion's reward: the weighted sum of the parts that apply to it. A completion
    that no function applies to (all None) has no reward: an error naming the row."""
    n = len(next(iter(parts.values())))
    totals = []
    for i in range(n):
        present = [(name, values[i]) for name, values in parts.items() if values[i] is not None]
        if not present:
            raise RewardFunctionError(f"row {row}, completion {i}: every reward function returned None "
                                      f"({', '.join(parts)}); at least one must score it")
        totals.append(sum(weights[name] * v for name, v in present))
    return totals
