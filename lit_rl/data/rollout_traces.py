"""What a rollout run records about each step's data: the traces under `<root>/rollouts/` and the
rollout statistics logged as `train/<name>`.

Traces are for people reading a run (which task, policy version, reward, completion) and for
tests that check no sample is trained twice across a resume or by two ranks. A run resumed from
a checkpoint older than its traces (a crash or an aborted stop after the last save) trained those
later steps into weights it no longer has: their lines move to `*.rolled_back.jsonl`
(`rewind_traces`), so the traces say what the weights were trained on and nothing is deleted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def rewind_traces(root: Path, step: int, rank: int) -> None:
    """Move the lines of steps >= `step` out of this rank's traces (rank 0: also the batch trace). A
    line that does not read back (cut short by the crash a resume follows) goes with them: it failed
    every resume, a JSONDecodeError before the first step."""
    names = [f"trained_rank{rank}.jsonl"] + (["trained.jsonl"] if rank == 0 else [])
    for name in names:
        path = root / "rollouts" / name
        if not path.is_file():
            continue
        lines = path.read_text().splitlines(keepends=True)
        later = [(at := _step_of(line)) is None or at >= step for line in lines]
        if any(later):
            with open(path.with_suffix(".rolled_back.jsonl"), "a") as f:
                f.writelines(line if line.endswith("\n") else line + "\n" for line, moved in zip(lines, later) if moved)
            path.write_text("".join(line for line, moved in zip(lines, later) if not moved))


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def trace_batch(root: Path, step: int, batch, replay: dict) -> None:
    """One line per trained step in `<root>/rollouts/trained.jsonl`: what was trained, from
    which task and policy version, with what reward, and which rows of each replay source."""
    path = root / "rollouts" / "trained.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = ("draw", "member", "task_index", "task_id", "completion", "rewards", "extra")
    rows = [{"policy_version": s.policy_version, "reward": s.reward, "finish_reason": s.finish_reason,
             **{k: s.metadata[k] for k in keep if k in s.metadata}} for s in batch]
    line = {"step": step, "batch": batch.index, "samples": rows}
    if replay:
        line["replay"] = {name: [s.metadata["row"] for s in samples] for name, samples in replay.items()}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def trace_share(root: Path, step: int, rank: int, mine: list) -> None:
    """Under several ranks, each rank writes the rollouts it trained, as `[draw, member]`, to
    `<root>/rollouts/trained_rank<r>.jsonl`, so a run shows which rank trained what (and that
    no two ranks trained the same sample)."""
    path = root / "rollouts" / f"trained_rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = [[s.metadata.get("draw"), s.metadata.get("member")] for s in mine]
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "samples": ids}) + "\n")


def rollout_stats(samples, staleness: list[int]) -> dict[str, float]:
    """What GRPO logs about the step's rollouts (every rank computes them from the whole batch;
    replay rows are not rollouts and are not in `samples`): `reward` is the samples' reward,
    `reward/<name>` the mean of each named part of it an environment reported, and
    `reward_metric/<name>` of what its reward functions logged (`RewardLog`).
    `completion_length` counts the tokens sampled, also of a sample a filter kept from training."""
    rewards = [s.reward for s in samples]
    staleness = [age for s, age in zip(samples, staleness) if s.has_sampling_logprobs] or [0]  # others never age
    advantages = [next((a for a, m in zip(s.advantages, s.loss_mask) if m), 0.0) for s in samples]
    lengths = [s.metadata.get("completion_tokens", sum(s.loss_mask)) for s in samples]
    mean_adv = sum(advantages) / len(advantages)
    parts: dict[str, list[float]] = {}  # an environment's named rewards (DatasetEnv's functions), where they apply
    logged: dict[str, list[float]] = {}
    for s in samples:
        for name, value in (s.metadata.get("rewards") or {}).items():
            if value is not None:
                parts.setdefault(name, []).append(value)
        for name, value in (s.metadata.get("reward_metrics") or {}).items():
            logged.setdefault(name, []).append(value)
    return {
        **{f"reward/{name}": sum(values) / len(values) for name, values in parts.items()},
        **{f"reward_metric/{name}": sum(values) / len(values) for name, values in logged.items()},
        "reward": sum(rewards) / len(rewards),
        "advantage_std": math.sqrt(sum((a - mean_adv) ** 2 for a in advantages) / len(advantages)),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
        "completion_length": sum(lengths) / len(lengths),
        "truncated_fraction": sum(s.truncated for s in samples) / len(samples),
    }
