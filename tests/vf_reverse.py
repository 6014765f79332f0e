"""A verifiers taskset written for the tests with verifiers 0.4's API (`verifiers.v1`), as a
taskset package is: a module exporting its `Taskset` subclass in `__all__` (taskset id
`vf_reverse`). The task: reverse a word; two weighted rewards and a metric."""

import verifiers.v1 as vf

from lit_rl.rollouts.envs import lcs_ratio

WORDS = ["hello", "lit-rl", "vllm", "token", "reward", "policy"]


class ReverseData(vf.TaskData):
    text: str


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def reversed_text(self, task, trace) -> float:
        return lcs_ratio(trace.last_reply, task.text[::-1])

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return 1.0 if len(trace.last_reply) <= 12 else 0.0

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


async def grader_down_on_lit_rl(task, trace) -> float:
    """A reward plugged by config (`taskset_args: {task: {rewards: {grader: {fn: ...}}}}`) that fails
    on one task."""
    if task.text == "lit-rl":
        raise RuntimeError("the grader is down")
    return 1.0


async def grader_nan_on_lit_rl(task, trace) -> float:
    """A plugged reward that gives NaN on one task (a judge that failed to parse, say)."""
    return float("nan") if task.text == "lit-rl" else 1.0


class ReverseTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self):
        for i, word in enumerate(WORDS):
            yield ReverseTask(ReverseData(id=f"w{i}", prompt=f"Reverse the text: {word}", text=word), self.config.task)


__all__ = ["ReverseTaskset"]
