"""Seconds to export an HF checkpoint (HFExport) against the I/O floor: writing the same
tensors with plain safetensors, fsync, and reading them back.

    .venv/bin/python bench/export.py [--sizes tiny,small,medium] [--repeats 3]

The export is measured through `HFExport.export` itself (state dict, weights, config,
tokenizer and chat template, fsync, rename, STABLE) on a single process; the first export
of a run (save_pretrained, which also proves the faster replay of later exports, see
lit_rl/callbacks/step_files.py) is reported apart; the trainer is a
minimal stand-in since only its run directory and rank are read on one process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config

from lit_rl.callbacks.export import HFExport

TINY = str(Path(__file__).resolve().parent.parent / "lit_rl" / "assets" / "tiny_qwen3")
SIZES = {  # hidden, layers, intermediate, vocab
    "tiny": (256, 4, 768, 320),
    "small": (512, 8, 1536, 32000),
    "medium": (1024, 12, 3072, 32000),
}


def build(size: str):
    hidden, layers, inter, vocab = SIZES[size]
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        tie_word_embeddings=True, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def floor_seconds(state: dict[str, torch.Tensor], where: Path) -> tuple[float, float]:
    """Plain safetensors: (write + fsync, write + fsync + read back)."""
    path = where / "floor.safetensors"
    start = time.perf_counter()
    save_file(state, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    written = time.perf_counter() - start
    load_file(str(path))
    took = time.perf_counter() - start
    path.unlink()
    return written, took


def export_seconds(export: HFExport, model, where: Path, step: int) -> float:
    module = SimpleNamespace(model=model, tokenizer_name=TINY, trust_remote_code=False)
    trainer = SimpleNamespace(
        default_root_dir=str(where), world_size=1, is_global_zero=True, strategy=SimpleNamespace(barrier=lambda *a: None)
    )
    start = time.perf_counter()
    export.export(trainer, module, step)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small,medium")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = []
    for size in args.sizes.split(","):
        model = build(size)
        params = sum(p.numel() for p in model.parameters())
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
        tmp = Path(tempfile.mkdtemp(prefix="lit_rl_bench_export_"))
        try:
            writes, floors, exports = [], [], []
            export = HFExport(keep_last=1)  # one callback per run, as in training (tokenizer loaded once)
            first = export_seconds(export, model, tmp, 0)  # the run's first export (general path) + warm-up
            floor_seconds(state, tmp)
            for r in range(1, args.repeats + 1):  # alternate the two so drift hits both alike
                w, f = floor_seconds(state, tmp)
                writes.append(w)
                floors.append(f)
                exports.append(export_seconds(export, model, tmp, r))
            w, f, e = statistics.median(writes), statistics.median(floors), statistics.median(exports)
            mb = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
            results.append({"size": size, "params_M": round(params / 1e6, 1), "MiB": round(mb, 1), "write_s": round(w, 3),
                            "floor_s": round(f, 3), "export_s": round(e, 3), "ratio": round(e / f, 2),
                            "ratio_write_only": round(e / w, 2),
                            "first_export_s": round(first, 3)})
            print(json.dumps(results[-1]), flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n| model | params | weights | safetensors write+fsync | + read back (floor) | HFExport | vs floor | vs write only "
          "| first export of the run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['size']} | {r['params_M']}M | {r['MiB']} MiB | {r['write_s']} s | {r['floor_s']} s | "
              f"{r['export_s']} s | {r['ratio']}x | {r['ratio_write_only']}x | {r['first_export_s']} s |")


if __name__ == "__main__":
    main()
