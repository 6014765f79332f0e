"""Test helpers: the built-in tiny model's path and datasets written to real local files."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = str(REPO / "lit_rl" / "assets" / "tiny_qwen3")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def reverse_rows(n: int, offset: int = 0) -> list[dict]:
    words = ["apple", "river", "stone", "light", "music", "green", "table", "water", "cloud", "bread", "tiger", "ocean"]
    rows = []
    for i in range(offset, offset + n):
        text = " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(1 + i % 3))
        rows.append({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]})
    return rows
