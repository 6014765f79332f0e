#!/usr/bin/env python
"""Inference benchmark: lit-rl's client against the raw `openai` client, and weight-reload latency.

1. Throughput: completion tokens per second through `InferenceClient.generate` and through a
   bare `openai.AsyncOpenAI().completions.create` making the very same request (prompt as ids,
   `logprobs=0`, `return_token_ids`, `ignore_eos`, temperature 1), on the same vLLM server, same
   prompts (chats rendered with the tiny model's template), same concurrency. Contenders run
   alternately for `--rounds` rounds after a warm-up; medians are reported. Target: lit-rl >= 0.95x.
2. Reload latency (medians): `InferenceClient.reload_weights` (generation paused, vLLM reload from
   disk + lit-rl's tied-head repair, prefix-cache reset, generation resumed, version update: five
   HTTP round trips, each also timed), the same through a client made for each reload (as a
   training run's weight sync does), alternately with the process's shared TLS context and with
   one built for the client (as every client did before 9609e20), vLLM's stock
   `/collective_rpc reload_weights` alone, and `safetensors.torch.load(path.read_bytes())` of the same files
   (page cache warm in all), alternating between two step directories, for the demo model and a
   larger random Qwen3 (`--big-*`).

    .venv/bin/python bench/inference.py                     # ~4 min on 2 cores
    .venv/bin/python bench/inference.py --skip-big --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = str(REPO / "lit_rl" / "assets" / "tiny_qwen3")
WORDS = "apple river stone light music green table water cloud bread tiger ocean north south quick brown fox".split()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=128, help="requests per round")
    p.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request (ignore_eos)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per contender; medians reported")
    p.add_argument("--reloads", type=int, default=10, help="timed reloads per model")
    p.add_argument("--enforce-eager", action="store_true", help="serve without compilation (faster start, slower decode)")
    p.add_argument("--big-hidden", type=int, default=1024)
    p.add_argument("--big-layers", type=int, default=8)
    p.add_argument("--skip-big", action="store_true", help="no larger model (reload latency of the demo model only)")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def write_checkpoint(path: Path, seed: int, config_overrides: dict | None = None) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lit_rl.run_dir import STABLE

    config = AutoConfig.from_pretrained(TINY_MODEL)
    for k, v in (config_overrides or {}).items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(path)
    (path / STABLE).touch()
    return path


def prompts(n: int) -> list[list[int]]:
    import random

    from transformers import AutoTokenizer

    from lit_rl.inference.client import chat_prompt_ids

    tok, rng = AutoTokenizer.from_pretrained(TINY_MODEL), random.Random(0)
    chats = [[{"role": "user", "content": "reverse: " + " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))}] for _ in range(n)]
    return [chat_prompt_ids(tok, m) for m in chats]


async def throughput(server, args) -> dict:
    import openai

    ids = prompts(args.prompts)
    client = server.client()
    raw = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=3)
    model = (await raw.models.list()).data[0].id

    async def lit_one(p):
        return len((await client.generate(p, max_tokens=args.max_tokens, ignore_eos=True))[0].completion_ids)

    async def raw_one(p):
        r = await raw.completions.create(model=model, prompt=p, max_tokens=args.max_tokens, temperature=1.0, top_p=1.0,
                                         logprobs=0, extra_body={"return_token_ids": True, "ignore_eos": True})
        c = r.choices[0]
        return len(c.model_extra["token_ids"]) if len(c.logprobs.token_logprobs) else 0

    async def run(one) -> float:
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded(p):
            async with sem:
                return await one(p)

        t = time.perf_counter()
        tokens = sum(await asyncio.gather(*[bounded(p) for p in ids]))
        return tokens / (time.perf_counter() - t)

    contenders = {"lit_rl": lit_one, "raw_openai": raw_one}
    for one in contenders.values():  # warm-up
        await run(one)
    results: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.rounds):
        for name in (list(contenders) if r % 2 == 0 else list(contenders)[::-1]):
            results[name].append(await run(contenders[name]))
            print(f"  round {r}: {name:10s} {results[name][-1]:8.0f} completion tokens/s", flush=True)
    await client.aclose()
    await raw.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    return {"tokens_per_s": results, "median": med, "ratio": med["lit_rl"] / med["raw_openai"]}


async def reload_latency(server, steps: list[Path], n: int) -> dict:
    from safetensors.torch import load

    async with server.client() as client:
        await client.reload_weights(steps[1])  # warm-up
        calls: dict[str, list[float]] = {}  # the reload's HTTP calls, each timed
        call = client._call

        async def timed(what, request):
            started = time.perf_counter()
            try:
                return await call(what, request)
            finally:
                calls.setdefault(what, []).append(time.perf_counter() - started)

        client._call = timed
        times, stock = [], []
        for i in range(n):
            t = time.perf_counter()
            await client.reload_weights(steps[i % 2])
            times.append(time.perf_counter() - t)
        client._call = call
        for i in range(n):  # vLLM's own reload alone: one /collective_rpc, nothing else
            t = time.perf_counter()
            await client._root.post("/collective_rpc", cast_to=object,
                                    body={"method": "reload_weights", "kwargs": {"weights_path": str(steps[i % 2])}})
            stock.append(time.perf_counter() - t)
    import httpx

    from lit_rl.inference import client as client_module

    fresh, own_tls = [], []
    shared = client_module.tls_context
    for i in range(2 * n):  # as a training run's sync does it: a client made for each reload,
        times_of = fresh if i % 2 == 0 else own_tls  # alternately with its own TLS context (before 9609e20)
        client_module.tls_context = shared if i % 2 == 0 else httpx.create_ssl_context
        try:
            t = time.perf_counter()
            async with server.client() as client:
                await client.reload_weights(steps[(i // 2) % 2])
            times_of.append(time.perf_counter() - t)
        finally:
            client_module.tls_context = shared
    async with server.client() as client:
        await client.reload_weights(steps[0])
    reads = []
    for i in range(n):
        t = time.perf_counter()
        for f in sorted(steps[i % 2].glob("*.safetensors")):
            load(f.read_bytes())  # every byte read and copied into tensors (load_file would only mmap)
        reads.append(time.perf_counter() - t)
    size = sum(f.stat().st_size for f in steps[0].glob("*.safetensors"))
    return {"bytes": size, "reload_s": times, "stock_reload_s": stock, "read_s": reads, "fresh_client_reload_s": fresh,
            "own_tls_reload_s": own_tls, "median_own_tls_reload_s": statistics.median(own_tls),
            "calls_s": calls, "median_reload_s": statistics.median(times),
            "median_stock_reload_s": statistics.median(stock), "median_read_s": statistics.median(reads),
            "median_fresh_client_reload_s": statistics.median(fresh),
            "median_calls_s": {what: statistics.median(v) for what, v in calls.items()}}


def serve(model_dir: Path, root: Path, args):
    from lit_rl.inference.server import VLLMServer

    server = VLLMServer(model_dir, dtype="float32", max_model_len=1024, enforce_eager=args.enforce_eager,
                        allowed_root=root, log_path=root / "vllm.log", startup_timeout=900)
    server.start()
    print(f"  server up after {server.startup_seconds:.1f} s (log {server.log_path})", flush=True)
    return server


def main(argv=None) -> dict:
    args = parse_args(argv)
    out: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="lit-rl-bench-inference-") as tmp:
        root = Path(tmp) / "tiny"
        steps = [write_checkpoint(root / "weights" / f"step_{i}", seed=i) for i in range(2)]
        print("demo model: throughput and reload", flush=True)
        with serve(steps[0], root, args) as server:
            out["startup_s_demo"] = server.startup_seconds
            out["throughput"] = asyncio.run(throughput(server, args))
            out["reload_demo"] = asyncio.run(reload_latency(server, steps, args.reloads))
        if not args.skip_big:
            big = {"hidden_size": args.big_hidden, "intermediate_size": 3 * args.big_hidden, "num_hidden_layers": args.big_layers,
                   "num_attention_heads": args.big_hidden // 64, "num_key_value_heads": args.big_hidden // 128,
                   "head_dim": 64, "layer_types": ["full_attention"] * args.big_layers}
            root = Path(tmp) / "big"
            steps = [write_checkpoint(root / "weights" / f"step_{i}", seed=i, config_overrides=big) for i in range(2)]
            print(f"larger model ({sum(f.stat().st_size for f in steps[0].glob('*.safetensors')) / 1e6:.0f} MB): reload", flush=True)
            with serve(steps[0], root, args) as server:
                out["startup_s_big"] = server.startup_seconds
                out["reload_big"] = asyncio.run(reload_latency(server, steps, args.reloads))
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def report(out: dict) -> None:
    t = out["throughput"]
    print("\n| client | completion tokens/s (median) |\n|---|---|")
    for name, v in t["median"].items():
        print(f"| {name} | {v:.0f} |")
    print(f"\nlit-rl / raw openai = {t['ratio']:.3f}\n")
    print("| model | safetensors | lit-rl reload_weights | the same, a client made for it | ... with its own TLS context "
          "(before 9609e20) | vLLM reload_weights alone | safetensors read |\n|---|---|---|---|---|---|---|")
    for key in ("reload_demo", "reload_big"):
        if key in out:
            r = out[key]
            print(f"| {key.split('_')[1]} | {r['bytes'] / 1e6:.1f} MB | {r['median_reload_s'] * 1e3:.0f} ms | "
                  f"{r['median_fresh_client_reload_s'] * 1e3:.0f} ms | {r['median_own_tls_reload_s'] * 1e3:.0f} ms | "
                  f"{r['median_stock_reload_s'] * 1e3:.0f} ms | "
                  f"{r['median_read_s'] * 1e3:.0f} ms |")
    for key in ("reload_demo", "reload_big"):
        if key in out:
            calls = ", ".join(f"{what} {s * 1e3:.1f} ms" for what, s in out[key]["median_calls_s"].items())
            print(f"\n{key.split('_')[1]}: lit-rl reload_weights's HTTP calls (medians): {calls}")

if __name__ == "__main__":
    sys.exit(main() and 0)
