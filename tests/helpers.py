"""Test helpers: the built-in tiny model's path, datasets written to real local files, the docs' YAML."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = str(REPO / "lit_rl" / "assets" / "tiny_qwen3")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def doc_yaml_blocks(page: str) -> list:
    """The YAML code blocks of a page of the repo (e.g. "docs/environments.md"), parsed, in order."""
    import yaml

    text = (REPO / page).read_text()
    return [yaml.safe_load(block) for block in re.findall(r"^```ya?ml\n(.*?)^```", text, flags=re.S | re.M)]


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
