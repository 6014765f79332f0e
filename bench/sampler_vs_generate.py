#!/usr/bin/env python
"""Do lit-rl's rollouts (a vLLM server) sample the distribution transformers' `generate` samples?

Why: from the same samples lit-rl's updates are TRL's to float32 rounding (`bench/grpo_same_samples.py`,
`bench/opd_same_samples.py`), so whatever is left between the two libraries in docs/benchmarks.md is in
the samples each draws: lit-rl's from its vLLM server, TRL's from `generate` on the trained model. The
servers' `mismatch_kl` checks that the logprobs vLLM reports for the tokens it sampled are the trainer's;
it cannot see a sampler that draws from another distribution than the one it reports. This can: the
same student, the same prompts (the first `--prompts` tasks of the reverse-text training set in lit-rl's
draw order), `--per-prompt` completions each at temperature 1 (no top-k, no top-p) and at most 48
tokens from each sampler, every completion then scored by the student in this process (float32):

- log p(completion): its expectation under the student's own distribution is minus the entropy of
  a completion; a sampler that favours likelier (or less likely) completions moves it;
- tokens, and the share of completions that end with the EOS token (the rest hit 48 tokens);
- the reverse-text reward (`ReverseTextEnv.reward`), what GRPO learns from.

Each line gives both means, their difference and that difference in standard errors (independent
samples). Two draws of one distribution differ by more than 2 SE about one time in twenty.

    .venv/bin/python bench/sampler_vs_generate.py                        # about 3 min on 2 cores
    .venv/bin/python bench/sampler_vs_generate.py --prompts 512 --per-prompt 8
    .venv/bin/python bench/sampler_vs_generate.py --student runs/opd_rkl_seeds/opd_reverse_kl/weights/step_40 \
        --reload-from runs/reverse_text_sft_short/weights/step_40         # served through a weight sync
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from _common import REPO, STUDENT, require_checkpoint  # noqa: E402
from trl_grpo import drawn_prompts  # noqa: E402

TRAIN = os.path.join(REPO, "examples", "reverse_text", "data", "train.jsonl")


def prompt_ids(tokenizer, tasks: list[dict]) -> list[list[int]]:
    from lit_rl.inference.client import chat_prompt_ids

    return [chat_prompt_ids(tokenizer, t["prompt"]) for t in tasks]


def sample_vllm(model_dir: str, prompts: list[list[int]], per_prompt: int, max_tokens: int,
                started_on: str | None = None) -> list[list[int]]:
    """lit-rl's rollout path: its client against a vLLM server lit-rl starts as a training run's
    (float32, eager), `n` completions per prompt, no seed (a fresh draw per request). With
    `started_on`, the server starts on those weights and is then reloaded to `model_dir`'s by
    the client's `reload_weights`, as a training run syncs it (the tied-head repair included)."""
    from lit_rl.inference.server import VLLMServer
    from lit_rl.run_dir import STABLE

    with tempfile.TemporaryDirectory(prefix="sampler-bench-") as root:
        if started_on:
            target = Path(root) / "weights" / "step_1"
            shutil.copytree(model_dir, target)
            (target / STABLE).touch()
        server = VLLMServer(started_on or model_dir, dtype="float32", max_model_len=512, enforce_eager=True,
                            allowed_root=root, log_path=Path(root) / "vllm.log", startup_timeout=900)
        server.start()
        try:
            async def draw() -> list[list[int]]:
                client = server.client()
                if started_on:
                    await client.reload_weights(target)
                sem = asyncio.Semaphore(32)

                async def one(p):
                    async with sem:
                        return await client.generate(p, n=per_prompt, max_tokens=max_tokens, temperature=1.0, top_p=1.0)

                try:
                    groups = await asyncio.gather(*[one(p) for p in prompts])
                finally:
                    await client.aclose()
                return [c.completion_ids for g in groups for c in g]

            return asyncio.run(draw())
        finally:
            server.stop()


def sample_generate(model, tokenizer, prompts: list[list[int]], per_prompt: int, max_tokens: int,
                    batch: int = 64) -> list[list[int]]:
    """TRL's path (`use_vllm=False`): `generate` on the model, left-padded batches, sampling at
    temperature 1 with top-k 0 and top-p 1, cut after the first EOS."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    rows = [p for p in prompts for _ in range(per_prompt)]
    out: list[list[int]] = []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
        for row in gen.tolist():
            end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            out.append(row[:end])
    return out


def scores(model, tokenizer, prompts: list[list[int]], completions: list[list[int]], texts: list[str],
           per_prompt: int) -> dict[str, list[float]]:
    """Per completion: the student's log p of it, its tokens, whether it ends with EOS, its reward."""
    import torch

    from lit_rl.rollouts.envs import lcs_ratio

    out = {"log p(completion)": [], "tokens": [], "ends with EOS": [], "reward": []}
    rows = [(p, c, t) for (p, t), group in zip(zip(prompts, texts), _groups(completions, per_prompt)) for c in group]
    for i in range(0, len(rows), 64):
        chunk = rows[i:i + 64]
        width = max(len(p) + len(c) for p, c, _ in chunk)
        ids = torch.tensor([p + c + [tokenizer.pad_token_id] * (width - len(p) - len(c)) for p, c, _ in chunk])
        mask = torch.tensor([[1] * (len(p) + len(c)) + [0] * (width - len(p) - len(c)) for p, c, _ in chunk])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        for j, (p, c, text) in enumerate(chunk):
            positions = torch.arange(len(p) - 1, len(p) + len(c) - 1)
            out["log p(completion)"].append(logprobs[j, positions, torch.tensor(c)].sum().item())
            out["tokens"].append(float(len(c)))
            out["ends with EOS"].append(float(c[-1] == tokenizer.eos_token_id))
            reply = tokenizer.decode(c, skip_special_tokens=True).strip()
            out["reward"].append(lcs_ratio(reply, text[::-1]))
    return out


def _groups(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def mean_se(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", default=STUDENT)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--per-prompt", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0, help="generate's torch seed")
    p.add_argument("--reload-from", default=None,
                   help="start the server on these weights, then reload it to --student's (a training run's sync)")
    args = p.parse_args(argv)
    require_checkpoint(p, "--student", args.student)
    import torch
    from transformers import AutoTokenizer

    from lit_rl.modules.model_loading import load_causal_lm

    student = os.path.abspath(args.student)
    tokenizer = AutoTokenizer.from_pretrained(student)
    tasks = drawn_prompts(TRAIN, args.prompts, 0)
    prompts, texts = prompt_ids(tokenizer, tasks), [t["text"] for t in tasks]
    print(f"{len(prompts)} prompts x {args.per_prompt} completions from each sampler", flush=True)
    started_on = os.path.abspath(args.reload_from) if args.reload_from else None
    label = "vLLM (lit-rl), reloaded" if started_on else "vLLM (lit-rl)"
    drawn = {label: sample_vllm(student, prompts, args.per_prompt, args.max_tokens, started_on)}
    model = load_causal_lm(student).eval()
    torch.manual_seed(args.seed)
    drawn["generate (TRL)"] = sample_generate(model, tokenizer, prompts, args.per_prompt, args.max_tokens)
    scored = {name: scores(model, tokenizer, prompts, c, texts, args.per_prompt) for name, c in drawn.items()}
    sa, sb = scored.values()
    print(f"\n| statistic | {' | '.join(scored)} | difference | in SE |\n|---|---:|---:|---:|---:|")
    result = {}
    for key in sa:
        (ma, ea), (mb, eb) = mean_se(sa[key]), mean_se(sb[key])
        z = (ma - mb) / math.sqrt(ea ** 2 + eb ** 2) if ea or eb else 0.0
        result[key] = {"vllm": (ma, ea), "generate": (mb, eb), "z": z}
        print(f"| {key} | {ma:.4f} ± {ea:.4f} | {mb:.4f} ± {eb:.4f} | {ma - mb:+.4f} | {z:+.1f} |")
    return result


if __name__ == "__main__":
    main()
