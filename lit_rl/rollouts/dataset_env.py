"""DatasetEnv: any dataset of prompts plus reward functions named in the config, no Python needed.

    env:
      class_path: lit_rl.rollouts.DatasetEnv
      init_args:
        path: data/math.jsonl             # hub name, json/jsonl/parquet/csv file or saved dataset
        prompt_column: question           # a string (one user turn) or chat messages
        system_prompt: "Put your final answer in \\boxed{}."
        rewards:
          - {function: lit_rl.rewards.math_verify, kwargs: {answer_column: answer}}
          - {function: my_rewards.brevity, weight: 0.1}

It is TRL's "dataset + reward_funcs" (the functions take TRL's signature, so the ones users have
work unchanged; see `lit_rl.rollouts.reward_functions`) as a lit-rl environment: the same
object serves GRPO rollouts, online evals and `lit-rl evaluate`. A sample's reward is the
weighted sum of the functions; each function's own value is kept in the sample's
``metadata["rewards"]`` and logged as ``train/reward/<name>`` (``eval/<env>/reward/<name>``).
What the functions log through TRL's ``log_metric`` and ``log_extra`` goes with the group's
samples the same way (`RewardLog`).
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from lit_rl.data.sources import open_split
from lit_rl.data.tools import normalize_tools
from lit_rl.data.samples import SampleGroup
from lit_rl.rollouts.context import RolloutContext
from lit_rl.rollouts.envs import Environment, EvalRun
from lit_rl.rollouts.reward_functions import PROVIDED, RewardFunction, RewardLog, RewardState, import_callable, weighted_sum

#: the step and the log of the rollout or eval being scored: set by `rollout` and `evaluate` for
#: the reward functions `score_group` calls (an asyncio task's own value, so concurrent rollouts
#: each see theirs), without changing `Environment.score_group`'s signature
_SCORING: contextvars.ContextVar[tuple[RewardState, RewardLog] | None] = contextvars.ContextVar("scoring", default=None)


class DatasetEnv(Environment):
    """Tasks are a dataset's rows; rewards are functions named by import path, each with a weight."""

    default_name = "dataset"

    def __init__(
        self,
        path: str,
        rewards: list[str | dict[str, Any]],
        prompt_column: str = "prompt",
        split: str = "train",
        subset: str | None = None,
        system_prompt: str | None = None,
        tools_column: str | None = None,
        filter: str | None = None,
        **kwargs,
    ):
        """
        Args:
            path: a local json/jsonl/parquet/csv file, a saved dataset, or a hub dataset name.
            rewards: the reward functions: an import path each, or ``{function, weight (1.0),
                name (the function's), kwargs}``. The sample's reward is the weighted sum.
            prompt_column: each row's prompt: a string (sent as one user message) or chat messages.
            split: the split, for hub datasets and saved dataset dictionaries.
            subset: the hub dataset's configuration, if it has several.
            system_prompt: a system message put before every prompt that has none of its own.
            tools_column: a column of tool definitions (a list, or its JSON text) rendered into
                each row's prompt during rollouts.
            filter: import path of ``fn(row) -> bool``; rows where it is false are left out
                (before ``num_examples`` takes the first N).
        """
        super().__init__(**kwargs)
        self.path, self.rewards, self.prompt_column, self.split, self.subset = path, rewards, prompt_column, split, subset
        self.system_prompt, self.tools_column, self.filter = system_prompt, tools_column, filter
        self._functions: list[RewardFunction] | None = None

    @property
    def functions(self) -> list[RewardFunction]:
        """The reward functions, resolved on first use: `load_tasks` does it when the run is set
        up, where an error is reported with the data's other problems before any server starts."""
        if self._functions is None:
            if not isinstance(self.rewards, list) or not self.rewards:
                raise ValueError(f"DatasetEnv: rewards must be a non-empty list of reward functions, got {self.rewards!r}")
            functions = [self._reward_function(i, spec) for i, spec in enumerate(self.rewards)]
            names = [f.name for f in functions]
            if len(set(names)) < len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"DatasetEnv: rewards: two functions are named {dup}; give each a distinct `name`")
            self._functions = functions
        return self._functions

    @staticmethod
    def _reward_function(i: int, spec) -> RewardFunction:
        where = f"DatasetEnv rewards[{i}]"
        if isinstance(spec, str):
            return RewardFunction(spec, where=where)
        if not isinstance(spec, dict) or "function" not in spec:
            raise ValueError(f"{where}: expected an import path or {{function, weight, name, kwargs}}, got {spec!r}")
        unknown = set(spec) - {"function", "weight", "name", "kwargs"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (allowed: function, weight, name, kwargs)")
        return RewardFunction(spec["function"], spec.get("weight", 1.0), spec.get("name"), spec.get("kwargs"), where)

    def load_tasks(self) -> list[dict]:
        functions = self.functions
        row_filter = import_callable(self.filter, "DatasetEnv filter") if self.filter else None
        rows = open_split(self.path, subset=self.subset, split=self.split)
        present = rows.column_names
        needed = {self.prompt_column: "prompt_column"}
        if self.tools_column:
            needed[self.tools_column] = "tools_column"
        for f in functions:
            needed.update({c: f"reward {f.name!r}" for c in f.columns if c not in needed})
        missing = [f"{c!r} (for {who})" for c, who in needed.items() if c not in present]
        if missing:
            raise ValueError(f"DatasetEnv: {self.path} has no column {', '.join(missing)}; its columns: {present}")
        clashing = [c for c in present if c in PROVIDED]
        if clashing and any(f.form == "trl" for f in functions):
            raise ValueError(f"DatasetEnv: {self.path} has column(s) {clashing} named as arguments TRL-form reward "
                             f"functions are given ({', '.join(PROVIDED)}); rename the column(s)")
        tasks = []
        for i, row in enumerate(rows):
            if row_filter is not None and not row_filter(row):
                continue
            task = {"id": str(i), "prompt": self._messages(i, row[self.prompt_column]), "row": row}
            if self.tools_column:
                task["tools"] = self._tools(i, row[self.tools_column])
            tasks.append(task)
        if not tasks:
            raise ValueError(f"DatasetEnv: no row of {self.path} passes the filter {self.filter!r}")
        return tasks

    def _messages(self, i: int, value) -> list[dict]:
        if isinstance(value, str) and value.strip():
            messages = [{"role": "user", "content": value}]
        elif isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
            messages = [{k: v for k, v in m.items() if v is not None} for m in value]  # datasets pads keys with None
        else:
            raise ValueError(f"DatasetEnv: row {i} of {self.path}, column {self.prompt_column!r}: expected a string "
                             f"or chat messages, got {value!r:.200}")
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def _tools(self, i: int, value) -> list[dict] | None:
        """A row's tool definitions, read (and checked) as rollouts render them: None, "" or []
        is no tools; bad JSON or a malformed tool names the row and column now, not mid-run."""
        try:
            return normalize_tools(value)
        except ValueError as e:
            raise ValueError(f"DatasetEnv: row {i} of {self.path}, column {self.tools_column!r}: {e}") from None

    def tools(self, task: dict) -> list[dict] | None:
        return task.get("tools") if self.tools_column else None

    async def score_group(self, completions: list[str], task: dict, completion_ids: list[list[int]] | None = None
                          ) -> tuple[list[float], dict[str, list[float | None]]]:
        """Every reward function over the group (concurrently), then their weighted sum."""
        n, row = len(completions), task["row"]
        prompt = row[self.prompt_column]
        conversational = not isinstance(prompt, str)
        texts = [[{"role": "assistant", "content": c}] for c in completions] if conversational else list(completions)
        columns = {k: [v] * n for k, v in row.items()}
        state, log = _SCORING.get() or (RewardState(), RewardLog())
        values = await asyncio.gather(*(
            f([prompt] * n, texts if f.form == "trl" else list(completions), columns, [task] * n, completion_ids,
              task["id"], state, log)
            for f in self.functions))
        parts = {f.name: v for f, v in zip(self.functions, values)}
        return weighted_sum(parts, {f.name: f.weight for f in self.functions}, task["id"]), parts

    async def rollout(self, task: dict, ctx: RolloutContext) -> SampleGroup:
        """`Environment.rollout`, with the functions' `RewardState` at the rollout's policy
        version, and what they logged put on each sample."""
        log = RewardLog()
        token = _SCORING.set((RewardState(ctx.policy_version), log))
        try:
            group = await super().rollout(task, ctx)
        finally:
            _SCORING.reset(token)
        if log.metrics or log.extra:
            means, extra = log.metric_means(), log.extra_of(len(group.samples), task["id"])
            for sample, columns in zip(group.samples, extra):
                sample.metadata.update({"reward_metrics": means} if means else {})
                sample.metadata.update({"extra": columns} if columns else {})
        return group

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        """`Environment.evaluate`, with the functions' `RewardState` at the checkpoint's step and
        the means of what they logged with `log_metric` as ``reward_metric/<name>``."""
        log = RewardLog()
        token = _SCORING.set((RewardState(run.step), log))
        try:
            metrics = await super().evaluate(run)
        finally:
            _SCORING.reset(token)
        return {**metrics, **{f"reward_metric/{name}": v for name, v in log.metric_means().items()}}

    def reward(self, completion: str, task: dict) -> float:
        raise NotImplementedError("DatasetEnv scores a group at once: call score_group")

    async def score(self, completion: str, task: dict) -> float:
        return (await self.score_group([completion], task))[0][0]
