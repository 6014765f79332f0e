"""Held-out exact match and mean reward of a reverse-text model: greedy decoding with transformers.

    python examples/reverse_text/exact_match.py --model runs/reverse_text_sft/weights/step_600

`--model` may be a trained step directory or, with `--random-init`, the untrained
built-in config (the "before" number). The reward is the one GRPO trains on
(`ReverseTextEnv.reward`: longest common subsequence with the reversed text over the
longer length, in [0, 1]). This is an offline check for the demo; online
evals during training go through an inference server instead.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoTokenizer

from lit_rl.modules.model_loading import load_causal_lm
from lit_rl.rollouts.envs import lcs_ratio


@torch.no_grad()
def score(model_dir: str, test_file: str, *, random_init: bool = False, batch_size: int = 50, seed: int = 0,
          samples: int = 0) -> dict:
    """{"exact_match": fraction, "reward": mean LCS ratio} of greedy decoding over the held-out
    chats; with `samples` > 0 also "sampled_reward": the mean reward of that many completions per
    chat sampled at temperature 1, the policy GRPO trains (greedy decoding sees only its mode)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = load_causal_lm(model_dir, random_init=random_init, seed=seed).eval()
    rows = [json.loads(line) for line in open(test_file)]
    hits, reward = 0, 0.0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        prompts = [tok.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True) for r in chunk]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        for row, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :]):
            text = tok.decode(ids, skip_special_tokens=True).strip()
            hits += text == row["messages"][1]["content"]
            reward += lcs_ratio(text, row["messages"][0]["content"][::-1])
    scores = {"exact_match": hits / len(rows), "reward": reward / len(rows)}
    if samples > 0:
        torch.manual_seed(seed)
        total = 0.0
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            prompts = [tok.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True) for r in chunk]
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=40, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 num_return_sequences=samples, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            for j, ids in enumerate(out[:, enc["input_ids"].shape[1] :]):
                text = tok.decode(ids, skip_special_tokens=True).strip()
                total += lcs_ratio(text, chunk[j // samples]["messages"][0]["content"][::-1])
        scores["sampled_reward"] = total / (len(rows) * samples)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--test", default="examples/reverse_text/data/test.jsonl")
    parser.add_argument("--random-init", action="store_true", help="score the untrained model built from the config")
    parser.add_argument("--samples", type=int, default=0, help="also the mean reward of N completions per chat sampled at temperature 1")
    args = parser.parse_args()
    scores = score(args.model, args.test, random_init=args.random_init, samples=args.samples)
    print(json.dumps({"model": args.model, "random_init": args.random_init, **scores}))


if __name__ == "__main__":
    main()
