#!/usr/bin/env python
"""LoRA against full fine-tuning: the weight sync to vLLM, and the trainer's memory per step.

1. Sync: the seconds and bytes of one RL weight sync, measured through lit-rl's own path
   (`HFExport.sync_export`, then `InferenceClient.reload_weights` for the full model or
   `reload_adapter` for the adapter, each with the pause, prefix-cache reset and version
   update), on the random Qwen3 shape of `bench/inference.py --big-*` (101M parameters, the
   tiny tokenizer), rank 16 on all linear layers. Two real vLLM servers run side by side: one
   serves the full model, one the frozen base with LoRA on; the two syncs alternate for
   `--rounds` rounds (the weights change before each, outside the timing), medians reported.
   Each LoRA sync is checked: the served log-probabilities of fixed ids equal the adapted model's.
   Target: LoRA >= 10x less time and >= 20x fewer bytes. The same two servers then generate
   (`--prompts` prompts of 16 ids, 64 new tokens each, all in flight, alternating, medians): what
   serving through vLLM's LoRA path costs rollouts.
2. Memory: peak resident set of a trainer process that takes `--steps` AdamW steps on the same
   model (8 rows of 256 tokens, loss on every token), full vs LoRA, each in a fresh child
   process (the peak of a process never goes down), alternating twice; also its seconds per step.

    .venv/bin/python bench/lora.py                 # ~5 min on 2 cores
    .venv/bin/python bench/lora.py --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = str(REPO / "lit_rl" / "assets" / "tiny_qwen3")
IDS = [5, 17, 60, 101, 33, 2, 250, 9, 77, 140]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8, help="alternating syncs of each kind; medians reported")
    p.add_argument("--steps", type=int, default=4, help="training steps per memory child")
    p.add_argument("--prompts", type=int, default=32, help="prompts per generation round")
    p.add_argument("--json", default=None)
    p.add_argument("--memory-child", choices=["full", "lora"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(TINY_MODEL)
    for k, v in {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
                 "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 128, "head_dim": 64,
                 "layer_types": ["full_attention"] * args.layers}.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def with_lora(model, rank: int):
    import torch

    from lit_rl.lora import LoRAOptions, add_adapter

    model = add_adapter(model, LoRAOptions(rank=rank, alpha=2.0 * rank))
    for name, p in model.named_parameters():
        if ".lora_B." in name:  # zero at init: make the adapter change the outputs, so the check means something
            torch.nn.init.normal_(p, std=0.02)
    return model


def stand_ins(root: Path, model):
    module = SimpleNamespace(model=model, tokenizer_name=TINY_MODEL, trust_remote_code=False)
    trainer = SimpleNamespace(default_root_dir=str(root), world_size=1, is_global_zero=True, ckpt_path=None,
                              global_step=0,  # a fresh run, one process
                              strategy=SimpleNamespace(barrier=lambda *a: None, broadcast=lambda obj, src=0: obj))
    return trainer, module


def perturb(model, lora: bool) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if not lora or ".lora_" in name:
                p.add_(torch.randn_like(p) * 1e-3)


def served_vs_model(client_factory, model) -> float:
    """Largest |served logprob - the model's| over the fixed ids."""
    import torch

    served = asyncio.run(score(client_factory))
    model.eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([IDS])).logits[0].double(), -1)
    model.train()
    return max(abs(served[i] - lp[i - 1, IDS[i]].item()) for i in range(1, len(IDS)))


async def generated_tokens_per_s(client_factory, prompts: int) -> float:
    async with client_factory() as client:
        started = time.perf_counter()
        outs = await asyncio.gather(*(client.generate([(7 * i + j) % 250 + 3 for j in range(16)], max_tokens=64,
                                                      ignore_eos=True, seed=i) for i in range(prompts)))
        return sum(len(c.completion_ids) for out in outs for c in out) / (time.perf_counter() - started)


async def score(client_factory):
    async with client_factory() as client:
        return await client.score(IDS)


def sync_bench(args) -> dict:
    from lit_rl.callbacks.export import HFExport
    from lit_rl.inference.runtime import ADAPTER_NAME
    from lit_rl.inference.server import VLLMServer
    from lit_rl.lora import lora_server_options
    from lit_rl.run_dir import base_dir

    full_model = build(args)
    lora_model = with_lora(copy.deepcopy(full_model), args.rank)
    params = sum(p.numel() for p in full_model.parameters())
    out = {"params": params, "adapter_params": sum(p.numel() for p in lora_model.parameters() if p.requires_grad)}
    with tempfile.TemporaryDirectory(prefix="lit-rl-bench-lora-") as tmp:
        kinds = {}
        for kind, model in (("full", full_model), ("lora", lora_model)):
            root = Path(tmp) / kind
            export = HFExport(keep_sync=2)
            trainer, module = stand_ins(root, model)
            first = export.sync_export(trainer, module, 0)
            options = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "allowed_root": root,
                       "log_path": root / "vllm.log", "startup_timeout": 900}
            served = first
            if kind == "lora":
                options, served = lora_server_options(options, args.rank), base_dir(root)
            server = VLLMServer(served, **options).start()
            print(f"{kind}: server up after {server.startup_seconds:.0f} s", flush=True)
            kinds[kind] = SimpleNamespace(root=root, export=export, trainer=trainer, module=module, server=server,
                                          model=model, times=[], bytes=[], worst=0.0, tokens_per_s=[])
        try:
            async def load(kind, path):
                k = kinds[kind]
                async with k.server.client() as client:
                    if kind == "full":
                        await client.reload_weights(path)
                    else:
                        await client.reload_adapter(path, ADAPTER_NAME)

            asyncio.run(load("lora", kinds["lora"].root / "sync" / "step_0"))
            for step in range(1, args.rounds + 1):
                for kind in ("full", "lora"):
                    k = kinds[kind]
                    perturb(k.model, lora=kind == "lora")
                    started = time.perf_counter()
                    path = k.export.sync_export(k.trainer, k.module, step)
                    asyncio.run(load(kind, path))
                    k.times.append(time.perf_counter() - started)
                    k.bytes.append(sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
                    name = ADAPTER_NAME if kind == "lora" else None
                    k.worst = max(k.worst, served_vs_model(lambda: k.server.client(model=name), k.model))
                print(f"round {step}: full {kinds['full'].times[-1]:.3f} s, lora {kinds['lora'].times[-1]:.3f} s", flush=True)
            for _ in range(3):
                for kind, k in kinds.items():
                    name = ADAPTER_NAME if kind == "lora" else None
                    k.tokens_per_s.append(asyncio.run(generated_tokens_per_s(lambda: k.server.client(model=name),
                                                                             args.prompts)))
                print(f"generation: full {kinds['full'].tokens_per_s[-1]:.0f}, lora {kinds['lora'].tokens_per_s[-1]:.0f} "
                      "tokens/s", flush=True)
        finally:
            for k in kinds.values():
                k.server.stop()
    for kind, k in kinds.items():
        out[kind] = {"sync_s": k.times, "median_sync_s": statistics.median(k.times), "bytes": statistics.median(k.bytes),
                     "largest_logprob_difference": k.worst, "tokens_per_s": statistics.median(k.tokens_per_s)}
    out["time_ratio"] = out["full"]["median_sync_s"] / out["lora"]["median_sync_s"]
    out["bytes_ratio"] = out["full"]["bytes"] / out["lora"]["bytes"]
    return out


def memory_child(args) -> None:
    """One trainer process: `--steps` AdamW steps, then its peak RSS and seconds per step as JSON."""
    import torch

    model = build(args)
    if args.memory_child == "lora":
        model = with_lora(model, args.rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (8, 256), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss_gb": peak_kb / 2**20, "step_s": statistics.median(times[1:] or times)}))


def memory_bench(args) -> dict:
    runs = {"full": [], "lora": []}
    for _ in range(2):
        for kind in runs:
            cmd = [sys.executable, __file__, "--memory-child", kind, "--hidden", str(args.hidden), "--layers",
                   str(args.layers), "--rank", str(args.rank), "--steps", str(args.steps)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"memory {kind}: {runs[kind][-1]}", flush=True)
    return {kind: {"peak_rss_gb": statistics.median(r["peak_rss_gb"] for r in rs),
                   "step_s": statistics.median(r["step_s"] for r in rs)} for kind, rs in runs.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.memory_child:
        memory_child(args)
        return {}
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "args": vars(args)}
    out["sync"] = sync_bench(args)
    out["memory"] = memory_bench(args)
    s, m = out["sync"], out["memory"]
    print(f"\n{s['params'] / 1e6:.0f}M parameters, adapter {s['adapter_params'] / 1e6:.2f}M (rank {args.rank}, all linear)")
    print("\n| | sync, median | bytes written per sync | largest served-vs-trained logprob difference | "
          "generated tokens/s | trainer peak RSS | s per training step |\n|---|---:|---:|---:|---:|---:|---:|")
    for kind in ("full", "lora"):
        print(f"| {kind} | {s[kind]['median_sync_s'] * 1e3:.0f} ms | {s[kind]['bytes'] / 1e6:.2f} MB | "
              f"{s[kind]['largest_logprob_difference']:.1e} | {s[kind]['tokens_per_s']:.0f} | "
              f"{m[kind]['peak_rss_gb']:.2f} GB | {m[kind]['step_s']:.2f} s |")
    print(f"\nfull / LoRA: {s['time_ratio']:.1f}x the sync time, {s['bytes_ratio']:.0f}x the bytes, "
          f"{m['full']['peak_rss_gb'] / m['lora']['peak_rss_gb']:.2f}x the peak RSS")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
