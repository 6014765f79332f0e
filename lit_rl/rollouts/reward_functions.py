"""Reward functions named in a config: resolved by import path, called over one task's group.

Two signatures are accepted, told apart by their parameter names:

- **TRL's** (``completions`` among the parameters): ``fn(prompts, completions, **columns) ->
  list[float | None]``, called once per group with one entry per completion. ``prompts`` and
  ``completions`` are chat messages when the dataset's prompts are messages (TRL's
  "conversational" format: a completion is ``[{"role": "assistant", "content": text}]``) and
  strings when they are strings; every other column of the row comes as a list, as do
  ``completion_ids`` (the sampled token ids) and ``task_ids``. ``None`` means "does not apply to
  this completion": it adds nothing to the weighted sum and is left out of that reward's mean.
- **lit-rl's per-sample form** (``completion`` among the parameters): ``fn(completion, task) ->
  float``, as `Environment.reward`, with ``task["row"]`` the dataset row.

Either may be ``async``. A sync function runs on the rollout loop, as TRL runs its reward
functions in its training loop: make a slow one async, or hand its work to a pool as
`lit_rl.rewards.math_verify` does. Keyword arguments in the config are bound first
(`functools.partial`), which is how the built-in rewards are told their column.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from lit_rl.rewards.extras import require

#: what a TRL-form function gets besides the dataset's columns; a parameter with one of these
#: names is never taken for a column
PROVIDED = ("prompts", "completions", "completion_ids", "task_ids", "trainer_state", "log_extra", "log_metric")


class RewardFunctionError(ValueError):
    """A reward function raised or returned something unusable for one group (retried, then the
    task rejected, under the rollout buffer's rules)."""


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
        self.fn = functools.partial(fn, **self.kwargs) if self.kwargs else fn
        self.weight, self.where = float(weight), where
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        params = inspect.signature(self.fn).parameters
        if "completions" in params:
            self.form = "trl"
        elif "completion" in params:
            self.form = "sample"
        else:
            raise ValueError(f"{where}: {self.name} takes ({', '.join(params)}); a reward function takes "
                             "(prompts, completions, **columns) as TRL's do, or (completion, task)")
        declared = getattr(fn, "required_columns", None)  # built-ins name the columns their kwargs point at
        if callable(declared):
            self.columns = list(declared(**self.kwargs))
        elif self.form == "trl":
            self.columns = [p.name for p in params.values() if p.name not in PROVIDED and p.default is p.empty
                            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        else:
            self.columns = []

    async def __call__(self, prompts: list, completions: list, columns: dict[str, list], tasks: list[dict],
                       completion_ids: list[list[int]] | None, row: Any) -> list[float | None]:
        """The function's value for each completion of one task's group, checked: one finite
        number (or None) per completion, else a `RewardFunctionError` naming it and the row."""
        try:
            if self.form == "trl":
                value = self.fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                task_ids=[t.get("id") for t in tasks], **columns)
                if inspect.isawaitable(value):
                    value = await value
                values = value
            else:
                values = []
                for completion, task in zip(completions, tasks):
                    one = self.fn(completion=completion, task=task)
                    values.append(await one if inspect.isawaitable(one) else one)
        except RewardFunctionError:
            raise
        except Exception as e:
            raise RewardFunctionError(f"reward function {self.name!r} raised on row {row}: {e!r}") from e
        return self.check(values, len(completions), row)

    def check(self, values: Any, n: int, row: Any) -> list[float | None]:
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
            raise RewardFunctionError(f"reward function {self.name!r} on row {row}: returned {type(values).__name__}; "
                                      f"expected a list of {n} numbers (one per completion)")
        if len(values) != n:
            raise RewardFunctionError(f"reward function {self.name!r} on row {row}: returned {len(values)} values "
                                      f"for {n} completions")
        out: list[float | None] = []
        for i, v in enumerate(values):
            if v is not None and (not isinstance(v, numbers.Real) or not math.isfinite(v)):
                raise RewardFunctionError(f"reward function {self.name!r} on row {row}: value {i} is {v!r}; "
                                          "expected a finite number or None")
            out.append(None if v is None else float(v))
        return out


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
