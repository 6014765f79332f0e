#!/usr/bin/env python
"""Multi-turn rollouts with one request for the turns asked together, and with a request per turn.

With `batch_prompts` on (lit_rl/inference/batching.py) the model turns of rollouts that ask at
the same moment share one request, and each gets its answer when the request's longest
completion ends: rollouts started together keep in step turn by turn. Off, each rollout goes at
its own pace but every turn is a request of its own. This runs the multi-turn tool-use
environment (`examples/tool_use/env.py`, `LookupEnv`, up to `--max-turns` model turns) through a
`RolloutBuffer` on one vLLM server (float32, eager) on the SFT student: `--tasks` tasks x
`--group-size` completions, all in flight, at most `--max-tokens` tokens a turn, temperature 1.
Both contenders alternate for `--rounds` rounds after a warm-up; wall time and the CPU time of
this process (the client side) per run, medians.

    .venv/bin/python bench/multiturn_batching.py          # about 3 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REPO, STUDENT, require_checkpoint  # noqa: E402

sys.path.insert(0, REPO)


async def run(env, client, tokenizer, args) -> tuple[float, float, int, int]:
    """Wall s, client CPU s, completion tokens and samples of one buffer run."""
    from lit_rl.rollouts.buffer import RolloutBuffer
    from lit_rl.rollouts.context import TrainSampling

    buffer = RolloutBuffer(env, client, tokenizer, TrainSampling(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0),
                           batch_size=args.tasks * args.group_size, group_size=args.group_size,
                           max_concurrency=args.tasks * args.group_size, max_staleness=None, num_batches=1)
    started, cpu_started, samples = time.perf_counter(), time.process_time(), 0
    async with buffer:  # the client is ours: the buffer does not close it
        async for batch in buffer:
            samples += len(batch)
    if buffer.counters["failed"] or buffer.counters["retries"]:
        raise RuntimeError(f"rollouts failed: {buffer.counters}")
    return time.perf_counter() - started, time.process_time() - cpu_started, buffer.counters["completion_tokens"], samples


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", default=STUDENT)
    p.add_argument("--tasks", type=int, default=32)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    require_checkpoint(p, "--student", args.student)
    from transformers import AutoTokenizer

    from examples.tool_use.env import LookupEnv
    from lit_rl.inference.server import VLLMServer

    student = os.path.abspath(args.student)
    tokenizer = AutoTokenizer.from_pretrained(student)
    env = LookupEnv(num_tasks=args.tasks, max_turns=args.max_turns)
    runs: dict[str, list[tuple[float, float, int, int]]] = {"batched": [], "per_call": []}
    with tempfile.TemporaryDirectory(prefix="multiturn-bench-") as root:
        with VLLMServer(student, dtype="float32", max_model_len=1024, enforce_eager=True, allowed_root=root,
                        log_path=Path(root) / "vllm.log", startup_timeout=900) as server:
            clients = {name: server.client(tokenizer=tokenizer, batch_prompts=name == "batched") for name in runs}

            async def rounds() -> None:
                for name in runs:  # warm-up: each client's pool and model name, the server's first batches
                    await run(env, clients[name], tokenizer, args)
                for rnd in range(args.rounds):
                    for name in (("batched", "per_call") if rnd % 2 == 0 else ("per_call", "batched")):
                        runs[name].append(await run(env, clients[name], tokenizer, args))
                        wall, cpu, tokens, samples = runs[name][-1]
                        print(f"round {rnd + 1} {name:9s} {wall:.2f} s, client CPU {cpu:.2f} s, {tokens} completion "
                              f"tokens, {samples} samples", flush=True)
                for client in clients.values():
                    await client.aclose()

            asyncio.run(rounds())
    print(f"\n{args.tasks} tasks x {args.group_size}, up to {args.max_turns} turns of {args.max_tokens} tokens, "
          f"medians of {args.rounds} rounds\n")
    print("| contender | wall s | client CPU s | completion tokens |\n|---|---:|---:|---:|")
    result = {}
    for name, values in runs.items():
        result[name] = {key: statistics.median(v[i] for v in values) for i, key in enumerate(("wall_s", "cpu_s", "tokens"))}
        print(f"| {name} | {result[name]['wall_s']:.2f} | {result[name]['cpu_s']:.2f} | {result[name]['tokens']:.0f} |")
    return result


if __name__ == "__main__":
    main()
