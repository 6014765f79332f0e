"""Reward functions the DatasetEnv tests name by import path (`reward_fns.<name>`), as a user's
config names theirs: TRL's signature and lit-rl's per-sample form, sync and async, plus broken ones.
Each records what it was given in `CALLS`, so a test can check the arguments."""

from __future__ import annotations

import asyncio

CALLS: list[dict] = []


def longer_is_better(prompts, completions, level, completion_ids, **columns):
    """TRL's signature, sync: the number of sampled tokens / 10, times the row's `level`."""
    CALLS.append({"fn": "longer_is_better", "prompts": prompts, "completions": completions, "level": level,
                  "completion_ids": completion_ids, "columns": sorted(columns)})
    return [len(ids) / 10 * lv for ids, lv in zip(completion_ids, level)]


async def mentions_answer(completion, task):
    """lit-rl's per-sample form, async: 1.0 when the row's answer is in the completion."""
    await asyncio.sleep(0)
    CALLS.append({"fn": "mentions_answer", "completion": completion, "row": task["row"]})
    return float(str(task["row"]["answer"]) in completion)


def only_level_two(prompts, completions, level, **columns):
    """None (does not apply) except on rows of level 2."""
    return [1.0 if lv == 2 else None for lv in level]


def fails_on_row_one(prompts, completions, task_ids, **columns):
    """Raises on the task whose row is 1; 0.5 elsewhere."""
    if "1" in task_ids:
        raise RuntimeError("the grader is down for row 1")
    return [0.5] * len(completions)


def grader_down(prompts, completions, **columns):
    """Always raises: a grader that went down."""
    raise RuntimeError("the grader is down")


def one_value_short(prompts, completions, **columns):
    return [0.0] * (len(completions) - 1)


def not_a_number(prompts, completions, **columns):
    return [float("nan")] * len(completions)


def no_completions_argument(prompt, answer):
    return 1.0


def not_skipped(row) -> bool:
    """A row filter: rows whose prompt says "skip" are left out."""
    return "skip" not in row["prompt"]


async def says_hello(prompts, completions, **columns):
    """TRL's signature, async, on conversational rows: 1.0 when the assistant message says hello."""
    await asyncio.sleep(0)
    CALLS.append({"fn": "says_hello", "prompts": prompts, "completions": completions})
    return [float("hello" in c[0]["content"]) for c in completions]


def shaped_by_step(prompts, completions, trainer_state, log_metric, log_extra, **columns):
    """TRL's progress-shaped reward: the step the group was sampled at, logging a metric and a column."""
    log_metric("completion_chars", sum(len(c) for c in completions) / len(completions))
    log_extra("chars", [len(c) for c in completions])
    return [float(trainer_state.global_step)] * len(completions)


def names_its_arguments(completions, question, answer):
    """No **kwargs: gets only what it names, the prompt column among them."""
    return [float(q.startswith("What") and a == "4") for q, a in zip(question, answer)]


def ramped(prompts, completions, trainer_state, max_steps, **columns):
    """Shaped by progress as docs/environments.md says: `max_steps` bound in the config's kwargs."""
    return [trainer_state.global_step / max_steps] * len(completions)


def numpy_values(prompts, completions, **columns):
    import numpy as np

    return np.arange(len(completions), dtype=np.float32)


def tensor_values(prompts, completions, **columns):
    import torch

    return torch.ones(len(completions))


def scalar_tensors(prompts, completions, **columns):
    import torch

    return [torch.tensor(0.25) for _ in completions]




JUDGE = {"in_flight": 0, "most": 0}


async def slow_judge(completion, task):
    """lit-rl's per-sample form, async and slow (an LLM judge): counts the calls in flight at once."""
    JUDGE["in_flight"] += 1
    JUDGE["most"] = max(JUDGE["most"], JUDGE["in_flight"])
    await asyncio.sleep(0.05)
    JUDGE["in_flight"] -= 1
    return float(len(completion))


def completion_without_task(completion):
    """lit-rl's per-sample form without its `task` parameter, which every call passes."""
    return 1.0
