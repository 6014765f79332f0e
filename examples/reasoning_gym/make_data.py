"""Writes SFT chats from a reasoning-gym generator: the user turn is the task's question, the
assistant turn its answer, exactly as `ReasoningGymEnv` prompts and scores them (no system
prompt, the answer given directly: ``system_prompt: null, answer_tag: null`` in grpo.yaml).

The tasks come from `--task-seed` (0); grpo.yaml trains on seed 2,000,000 and evals use 1,000,000.
reasoning-gym draws task i of a dataset with seed s from `Random(s + i)`, so seeds 0 and 1 share
all but one task: a held-out seed must lie beyond the training tasks' range. spell_backward also
draws its words from a fixed list, so a held-out word can still appear here: the script prints
how many do.

    python examples/reasoning_gym/make_data.py --out examples/reasoning_gym/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lit_rl.rollouts import ReasoningGymEnv
from lit_rl.rollouts.reasoning_gym_env import held_out_overlap


def env(task_seed: int, size: int, args) -> ReasoningGymEnv:
    return ReasoningGymEnv(args.dataset, size=size, task_seed=task_seed, config=json.loads(args.config),
                           system_prompt=None, answer_tag=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="examples/reasoning_gym/data")
    parser.add_argument("--dataset", default="spell_backward")
    parser.add_argument("--config", default='{"max_word_len": 6}', help="the dataset's options, JSON")
    parser.add_argument("--size", type=int, default=4000, help="SFT chats")
    parser.add_argument("--task-seed", type=int, default=0)
    parser.add_argument("--held-out-seed", type=int, default=1_000_000, help="only to count the overlap")
    parser.add_argument("--held-out-size", type=int, default=200)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = env(args.task_seed, args.size, args).tasks()
    with open(out / "train.jsonl", "w") as f:
        for t in tasks:
            f.write(json.dumps({"messages": [*t["prompt"], {"role": "assistant", "content": t["entry"]["answer"]}]}) + "\n")
    repeated = held_out_overlap(env(args.task_seed, args.size, args), env(args.held_out_seed, args.held_out_size, args))
    print(f"wrote {len(tasks)} chats to {out / 'train.jsonl'} ({args.dataset}, task seed {args.task_seed}); "
          f"{repeated} of the {args.held_out_size} held-out tasks (seed {args.held_out_seed}) ask a question asked here")


if __name__ == "__main__":
    main()
