#!/usr/bin/env python
"""SFT throughput on the GPUs of one machine, FSDP2 with bf16 mixed precision, through the real
CLI (configs/strategies/fsdp2.yaml): trained tokens per second and model FLOPs utilisation.

The model is Qwen3-0.6B-shaped (28 layers, hidden 1024, 16/8 heads of 128, MLP 3072, the real
vocabulary of 151,936, tied embeddings) with random weights; the built-in tiny model's
byte-level tokenizer gives the ids (fine for timing, the ids are only smaller). Rows are a
one-character question and a long answer, so nearly every token is trained.

MFU = 6 x parameters x trained tokens per second / (GPUs x peak bf16 FLOP/s). Attention's own
FLOPs and the few untrained positions are not counted: the number is a lower bound.
Throughput is the median of `train/tokens_per_s` over the steps after `--warmup`.

    python bench/gpu_sft.py --steps 10 --warmup 3        # bench/gpu_check.sh runs this
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import _text_pool  # noqa: E402

QWEN3_06B = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "tie_word_embeddings": True, "layer_types": ["full_attention"] * 28, "max_window_layers": 28,
}
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}  # dense, per GPU


def write_model(path: Path) -> int:
    """The Qwen3-0.6B-shaped config beside the tiny model's tokenizer; returns its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(REPO / "lit_rl" / "assets" / "tiny_qwen3", path)
    config = json.loads((path / "config.json").read_text())
    config.update(QWEN3_06B)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())  # a tied parameter is counted once


def write_rows(path: Path, n: int, length: int) -> None:
    pool = _text_pool(0, size=n * length + length)
    with open(path, "w") as f:
        for i in range(n):
            answer = pool[i * length:(i + 1) * length]
            f.write(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": answer}]}) + "\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows-per-gpu", type=int, default=16, help="rows per optimizer step and GPU")
    p.add_argument("--row-chars", type=int, default=2000, help="answer length (about one token a character)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--peak-flops", type=float, default=None, help="peak bf16 FLOP/s of one GPU (default: by name)")
    args = p.parse_args(argv)

    import torch

    gpus = torch.cuda.device_count()
    if not gpus:
        raise SystemExit("bench/gpu_sft.py needs CUDA GPUs")
    name = torch.cuda.get_device_name(0)
    peak = args.peak_flops or next((v for k, v in PEAK_BF16.items() if k in name), None)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = write_model(tmp / "model")
        write_rows(tmp / "train.jsonl", args.rows_per_gpu * gpus * (args.steps + 1), args.row_chars)
        cmd = [
            sys.executable, "-m", "lit_rl.cli", "fit", "--config", str(REPO / "examples/reverse_text/sft.yaml"),
            "--config", str(REPO / "configs/strategies/fsdp2.yaml"),
            "--model.init_args.model", str(tmp / "model"), "--model.init_args.random_init", "true",
            "--model.init_args.sharding.mixed_precision", "bfloat16",
            "--model.init_args.gradient_checkpointing", str(args.gradient_checkpointing).lower(),
            "--data.init_args.path", str(tmp / "train.jsonl"), "--data.init_args.val_path", "",
            "--data.init_args.batch_size", str(args.rows_per_gpu * gpus), "--data.init_args.packing", "packed",
            "--data.init_args.micro_batch_tokens", str(args.micro_batch_tokens),
            "--data.init_args.max_length", str(args.row_chars + 64), "--data.init_args.num_workers", "2",
            "--trainer.max_steps", str(args.steps), "--trainer.log_every_n_steps", "1",
            "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
            "--trainer.default_root_dir", str(tmp / "run"),
        ]
        out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"lit-rl fit failed:\n{out.stderr[-4000:]}")
        (metrics,) = (tmp / "run").glob("logs/version_*/metrics.csv")
        rows = [r for r in csv.DictReader(open(metrics)) if r.get("train/tokens_per_s")]
    timed = [float(r["train/tokens_per_s"]) for r in rows if int(r["step"]) >= args.warmup]
    tokens_per_s = statistics.median(timed)
    result = {
        "gpus": gpus, "gpu": name, "parameters": params, "steps_timed": len(timed),
        "trained_tokens_per_step": float(rows[-1]["train/tokens"]), "tokens_per_s": round(tokens_per_s),
        "tokens_per_s_per_gpu": round(tokens_per_s / gpus),
        "peak_memory_gb_rank0": float(rows[-1]["train/peak_memory_gb"]),
        "mfu": round(6 * params * tokens_per_s / (gpus * peak), 4) if peak else None,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
