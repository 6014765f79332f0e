#!/usr/bin/env python
"""What a teacher server's scoring of one OPD step costs, with and without vLLM's tokenizer.

An OPD step (opd.yaml: 64 tasks x 1 completion, the teacher on its own vLLM server) asks the
teacher for the log-probabilities of every sampled token and its top k tokens at each position
(`InferenceClient.score_top_k`, one request for the 64 samples). The teacher only scores ids, yet
a vLLM server with its tokenizer turns every one of the top-k tokens at every position into text
for the answer. This starts two servers on the teacher as a training run starts its teacher
(float32, eager), one with `--skip-tokenizer-init` (what lit-rl's runtime starts for a teacher that
only scores since 2026-12-07, `lit_rl.inference.runtime.scoring_only`) and one without (before),
and times 64 concurrent `score_top_k` calls on each, alternating, for each k: the samples are the
reverse-text training chats with the reversed text as the answer (the teacher's own tokens).
Reports the wall time and this process's CPU time per round (medians), and checks that both
servers return the same scores and top tokens.

    .venv/bin/python bench/teacher_scoring.py          # about 2 min on 2 cores
    .venv/bin/python bench/teacher_scoring.py --top-k 20 --rounds 9
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

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from _common import TEACHER, require_checkpoint  # noqa: E402
from sampler_vs_generate import TRAIN  # noqa: E402
from trl_grpo import drawn_prompts  # noqa: E402

CONTENDERS = {"no_tokenizer": ["--skip-tokenizer-init"], "tokenizer": []}


def sequences(tokenizer, n: int) -> list[list[int]]:
    """`n` training chats, each with the reversed text as the assistant's answer, as token ids."""
    chats = []
    for task in drawn_prompts(TRAIN, n, 0):
        answer = {"role": "assistant", "content": task["text"][::-1]}
        text = tokenizer.apply_chat_template([*task["prompt"], answer], tokenize=False)
        chats.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return chats


async def score_all(server, chats: list[list[int]], k: int):
    async with server.client() as client:
        return await asyncio.gather(*[client.score_top_k(ids, k) for ids in chats])


def same(a, b) -> bool:
    """Equal scores and top-k log-probabilities (to 1e-5) and the same top tokens."""
    for (sa, ia, la), (sb, ib, lb) in zip(a, b):
        if ia != ib or max(abs(x - y) for x, y in zip(sa + sum(la, []), sb + sum(lb, []))) > 1e-5:
            return False
    return len(a) == len(b)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default=TEACHER)
    p.add_argument("--calls", type=int, default=64, help="samples scored together (opd.yaml's batch)")
    p.add_argument("--top-k", default="20,0", help="comma separated k of score_top_k (opd.yaml: 20; 0: the sampled token only)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    require_checkpoint(p, "--teacher", args.teacher)
    from transformers import AutoTokenizer

    from lit_rl.inference.server import VLLMServer

    teacher = os.path.abspath(args.teacher)
    ks = [int(k) for k in args.top_k.split(",") if k.strip()]
    chats = sequences(AutoTokenizer.from_pretrained(teacher), args.calls)
    print(f"{len(chats)} samples of {min(map(len, chats))}-{max(map(len, chats))} tokens", flush=True)
    wall = {(c, k): [] for c in CONTENDERS for k in ks}
    cpu = {(c, k): [] for c in CONTENDERS for k in ks}
    with tempfile.TemporaryDirectory(prefix="teacher-scoring-bench-") as root:
        servers = {c: VLLMServer(teacher, dtype="float32", max_model_len=512, enforce_eager=True, dev_mode=False,
                                 extra_args=extra, log_path=Path(root) / f"vllm_{c}.log", startup_timeout=900)
                   for c, extra in CONTENDERS.items()}
        try:
            for server in servers.values():
                server.start()
            for k in ks:  # warm-up, and both servers' answers compared
                answers = {c: asyncio.run(score_all(s, chats, k)) for c, s in servers.items()}
                if not same(*answers.values()):
                    raise RuntimeError(f"k={k}: the two servers' scores differ")
            for rnd in range(args.rounds):
                order = list(CONTENDERS) if rnd % 2 == 0 else list(CONTENDERS)[::-1]
                for k in ks:
                    for c in order:
                        started, cpu_started = time.perf_counter(), time.process_time()
                        asyncio.run(score_all(servers[c], chats, k))
                        wall[c, k].append(time.perf_counter() - started)
                        cpu[c, k].append(time.process_time() - cpu_started)
                        print(f"round {rnd + 1} k={k:<3d} {c:13s} {wall[c, k][-1]:.3f} s, client CPU {cpu[c, k][-1]:.3f} s",
                              flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print(f"\n{args.calls} concurrent score_top_k calls, medians of {args.rounds} rounds (the answers of both servers equal)\n")
    print("| k | server | wall s | client CPU s |\n|---:|---|---:|---:|")
    result = {}
    for k in ks:
        for c in CONTENDERS:
            result[f"{c}_k{k}"] = {"wall_s": statistics.median(wall[c, k]), "cpu_s": statistics.median(cpu[c, k])}
            flag = "`--skip-tokenizer-init`" if CONTENDERS[c] else "with its tokenizer"
            print(f"| {k} | {flag} | {result[f'{c}_k{k}']['wall_s']:.3f} | {result[f'{c}_k{k}']['cpu_s']:.3f} |")
    return result


if __name__ == "__main__":
    main()
