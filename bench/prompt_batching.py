#!/usr/bin/env python
"""What 64 rollouts that start together cost as 64 requests and as one (`lit_rl.inference.batching`).

A training step of opd.yaml starts 64 rollouts at once, each asking the policy's server for one
completion. This times that moment alone, on one vLLM server started as a training run starts it
(float32, eager) on the SFT student: 64 concurrent `InferenceClient.generate` calls of the first
prompts of the reverse-text training set, each 16 tokens long (`ignore_eos`, so every contender
makes the same tokens), temperature 1, and reports the wall time and the CPU time of this process
(the client side) per round:

- `batched`: lit-rl's client as it is (`batch_prompts=True`): one request of 64 prompts;
- `per_call`: `batch_prompts=False`: 64 requests of one prompt each (lit-rl before 2026-12-06);
- `raw_one_request`: one bare `openai` request with the 64 prompts (the floor);
- `per_call_aiohttp` (not in the default set; `pip install httpx-aiohttp` first): the 64 requests
  through openai's aiohttp transport (`openai.DefaultAioHttpClient`) instead of httpx's
  connection pool, whose bookkeeping grows with the square of the requests in flight.

Contenders alternate for `--rounds` rounds after a warm-up; medians.

    .venv/bin/python bench/prompt_batching.py            # about 1 min on 2 cores
    .venv/bin/python bench/prompt_batching.py --contenders batched,per_call,per_call_aiohttp,raw_one_request
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
from _common import STUDENT, require_checkpoint  # noqa: E402
from sampler_vs_generate import TRAIN, prompt_ids  # noqa: E402
from trl_grpo import drawn_prompts  # noqa: E402

CONTENDERS = ("batched", "per_call", "raw_one_request", "per_call_aiohttp")


async def draw(server, prompts: list[list[int]], contender: str, tokens: int) -> int:
    """The contender's 64 completions; returns the completion tokens it got back."""
    client = server.client(batch_prompts=contender == "batched")
    if contender == "per_call_aiohttp":
        import openai

        client.openai = openai.AsyncOpenAI(base_url=client.base_url, api_key="EMPTY",
                                           http_client=openai.DefaultAioHttpClient())
    try:
        if contender == "raw_one_request":
            answer = await client.openai.completions.create(
                model=await client._model_name(), prompt=prompts, max_tokens=tokens, temperature=1.0, top_p=1.0,
                logprobs=0, extra_body={"return_token_ids": True, "ignore_eos": True})
            return sum(len(c.model_extra["token_ids"]) for c in answer.choices)
        groups = await asyncio.gather(*[client.generate(p, max_tokens=tokens, ignore_eos=True) for p in prompts])
        return sum(len(c.completion_ids) for g in groups for c in g)
    finally:
        await client.aclose()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", default=STUDENT)
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--contenders", default="batched,per_call,raw_one_request", help=f"comma separated, of {CONTENDERS}")
    args = p.parse_args(argv)
    contenders = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
    if not contenders or set(contenders) - set(CONTENDERS):
        p.error(f"--contenders: use some of {CONTENDERS}")
    if "per_call_aiohttp" in contenders:
        try:
            import httpx_aiohttp  # noqa: F401
        except ImportError:
            p.error("per_call_aiohttp needs httpx-aiohttp: .venv/bin/pip install httpx-aiohttp")
    require_checkpoint(p, "--student", args.student)
    from transformers import AutoTokenizer

    from lit_rl.inference.server import VLLMServer

    student = os.path.abspath(args.student)
    tokenizer = AutoTokenizer.from_pretrained(student)
    prompts = prompt_ids(tokenizer, drawn_prompts(TRAIN, args.calls * (args.rounds + 1) * len(contenders), 0))
    batches = iter(prompts[i:i + args.calls] for i in range(0, len(prompts), args.calls))
    wall: dict[str, list[float]] = {c: [] for c in contenders}
    cpu: dict[str, list[float]] = {c: [] for c in contenders}
    with tempfile.TemporaryDirectory(prefix="batching-bench-") as root:
        with VLLMServer(student, dtype="float32", max_model_len=512, enforce_eager=True, allowed_root=root,
                        log_path=Path(root) / "vllm.log", startup_timeout=900) as server:
            for contender in contenders:  # warm-up: the server's first batches, each client path once
                asyncio.run(draw(server, next(batches), contender, args.tokens))
            for rnd in range(args.rounds):
                order = contenders if rnd % 2 == 0 else contenders[::-1]
                for contender in order:
                    started, cpu_started = time.perf_counter(), time.process_time()
                    got = asyncio.run(draw(server, next(batches), contender, args.tokens))
                    wall[contender].append(time.perf_counter() - started)
                    cpu[contender].append(time.process_time() - cpu_started)
                    if got != args.calls * args.tokens:
                        raise RuntimeError(f"{contender}: {got} completion tokens, expected {args.calls * args.tokens}")
                    print(f"round {rnd + 1} {contender:17s} {wall[contender][-1]:.3f} s, client CPU {cpu[contender][-1]:.3f} s",
                          flush=True)
    print(f"\n{args.calls} concurrent calls x {args.tokens} tokens, medians of {args.rounds} rounds\n")
    print("| contender | wall s | client CPU s |\n|---|---:|---:|")
    result = {}
    for contender in contenders:
        result[contender] = {"wall_s": statistics.median(wall[contender]), "cpu_s": statistics.median(cpu[contender])}
        print(f"| {contender} | {result[contender]['wall_s']:.3f} | {result[contender]['cpu_s']:.3f} |")
    return result


if __name__ == "__main__":
    main()
