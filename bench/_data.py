"""Deterministic synthetic chats for the benchmarks in bench/.

The built-in tiny tokenizer (lit_rl/assets/tiny_qwen3) is byte-level with no merges: one
ASCII character is one token. A one-turn chat rendered with its template costs a fixed
scaffold of `SCAFFOLD_TOKENS` tokens (``<|im_start|>user\\n`` ... ``<|im_end|>\\n``), so a
chat of exactly N rendered tokens has N - SCAFFOLD_TOKENS characters of content, split at
random between the user turn and the assistant turn. The assistant body plus its
``<|im_end|>`` are the trained tokens.
"""

from __future__ import annotations

import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = os.path.join(REPO, "lit_rl", "assets", "tiny_qwen3")

# <|im_start|> user \n ... <|im_end|> \n <|im_start|> assistant \n ... <|im_end|> \n
SCAFFOLD_TOKENS = 1 + 5 + 0 + 1 + 1 + 1 + 10 + 0 + 1 + 1

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but were "
    "apple river stone light music green table water cloud bread tiger ocean number reverse sort list "
    "answer question city north south east west small large quick brown fox jumps over lazy dog"
).split()


def _text_pool(seed: int, size: int = 1 << 16) -> str:
    rng = random.Random(seed)
    words, length = [], 0
    while length < size:
        w = rng.choice(_WORDS)
        words.append(w)
        length += len(w) + 1
    return " ".join(words)


def make_chats(n: int, *, seed: int = 0, min_tokens: int = 24, max_tokens: int = 120):
    """Yield `n` one-turn chats ({"messages": [user, assistant]}), each exactly `min_tokens`..`max_tokens`
    tokens long once rendered with the tiny model's chat template (length uniform in that range)."""
    if min_tokens < SCAFFOLD_TOKENS + 2:
        raise ValueError(f"min_tokens must be >= {SCAFFOLD_TOKENS + 2} (the template scaffold plus one character a turn)")
    rng = random.Random(seed)
    pool = _text_pool(seed)
    span = len(pool) - max_tokens
    for _ in range(n):
        body = rng.randint(min_tokens, max_tokens) - SCAFFOLD_TOKENS
        user_len = rng.randint(1, body - 1)
        a, b = rng.randrange(span), rng.randrange(span)
        user = pool[a : a + user_len]
        answer = pool[b : b + body - user_len]
        yield {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def write_chats_jsonl(path: str, n: int, **kwargs) -> str:
    with open(path, "w") as f:
        for row in make_chats(n, **kwargs):
            f.write(json.dumps(row) + "\n")
    return path
