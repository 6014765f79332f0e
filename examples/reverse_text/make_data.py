"""Writes the reverse-text chat dataset: the user sends a short text, the assistant
answers with the text reversed character by character.

Deterministic: the same seed gives the same files. Train and test texts never overlap.

    python examples/reverse_text/make_data.py --out examples/reverse_text/data
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "apple river stone light music green table water cloud bread paper horse ocean "
    "plant sugar tiger chair glass dream smile voice train field night storm heart "
    "sound world house earth bird fish moon star tree rain snow wind fire gold blue "
    "red cat dog sun sky sea map pen cup box key hat car bus road hill lake rock "
    "salt milk rice corn leaf seed rose wolf bear frog duck lion king queen book "
    "song poem word line page door wall roof yard farm town city park shop bank"
).split()


def make_text(rng: random.Random, max_chars: int) -> str:
    while True:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        if len(text) <= max_chars:
            return text


def row(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="examples/reverse_text/data")
    parser.add_argument("--train", type=int, default=20000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--max-chars", type=int, default=14)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    test_texts: list[str] = []
    seen: set[str] = set()
    while len(test_texts) < args.test:
        text = make_text(rng, args.max_chars)
        if text not in seen:
            seen.add(text)
            test_texts.append(text)
    train_texts = []
    while len(train_texts) < args.train:
        text = make_text(rng, args.max_chars)
        if text not in seen:  # held-out texts never appear in training
            train_texts.append(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, texts in (("train", train_texts), ("test", test_texts)):
        with open(out / f"{name}.jsonl", "w") as f:
            for text in texts:
                f.write(json.dumps(row(text)) + "\n")
    print(f"wrote {len(train_texts)} train and {len(test_texts)} test rows to {out}")


if __name__ == "__main__":
    main()
