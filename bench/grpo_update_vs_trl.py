"""One GRPO update as TRL's GRPOTrainer computes it (`_compute_loss`, TRL 1.16) and as lit-rl's
`GRPO` does (`target_logprobs` on a packed micro-batch, `policy_loss_sums` over the step's
tokens), from the same weights, tokens, advantages and old logprobs: the largest difference
between the two gradients, relative to the gradient's largest entry.

Why: in docs/benchmarks.md lit-rl's GRPO learns level with TRL's at T=1 and a little below it
at T=0.7 (eight seeds), and at lr 3e-4 two updates per batch were below TRL's. This separates
the update from the sampling: if both compute the same gradient, at the first update of a
batch (ratio 1) and at the second (after an AdamW step, with the clipped ratio live), at T=1
and at T=0.7, what is left between them is the samples each drew.

    .venv/bin/python bench/grpo_update_vs_trl.py

Settings are grpo.yaml's and bench/trl_grpo.py's (DAPO's token mean, clip 0.2 / 0.28, no KL,
AdamW without weight decay) on 16 completions (2 prompts x 8) of 4-19 tokens after prompts of
5-12 tokens, on the built-in tiny Qwen3 with random weights whose logits are sharpened (x8).
The AdamW step between the two updates has lr 1e-5, so that about half of the tokens are clipped
at the second (at grpo.yaml's 1e-4 over 90% are, on these sharp random weights).
"""

from __future__ import annotations

import copy
import sys
import tempfile

import torch

from _common import REPO, TINY_MODEL

sys.path.insert(0, REPO)
CLIP_LOW, CLIP_HIGH, LR = 0.2, 0.28, 1e-5


def samples(vocab: int, n: int = 16, seed: int = 0):
    """`n` prompt + completion token rows with an advantage each (per group of 8: mean 0)."""
    from lit_rl.data.samples import Sample

    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(n, generator=g)
    adv = (adv.view(-1, 8) - adv.view(-1, 8).mean(1, keepdim=True)).flatten()
    rows = []
    for i in range(n):
        prompt, completion = 5 + i % 8, 4 + (i * 7) % 16
        ids = torch.randint(0, vocab, (prompt + completion,), generator=g).tolist()
        mask = [t >= prompt for t in range(len(ids))]
        rows.append(Sample(input_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids), reward=0.0,
                           source="policy").with_advantage(float(adv[i])))
    return rows


def prompt_length(row) -> int:
    """Tokens before the completion: the first trained one."""
    return row.loss_mask.index(True)


def lit_rl_loss(module, micro_batch, process, old):
    """lit-rl's GRPO loss for one micro-batch holding the whole step: the module's logprobs, its
    settings and normaliser (`GRPO.micro_batch_loss_sum` reads the update's old logprobs from a
    running trainer, which this bench does not start; the sampler's logprobs are the old ones)."""
    from lit_rl.losses import policy_loss_sums

    logprobs, _ = module.target_logprobs(micro_batch, process=process)
    old = logprobs.detach() if old is None else old
    loss_sum, _ = policy_loss_sums(logprobs, old, old, micro_batch["advantages"], micro_batch["loss_mask"],
                                   micro_batch["sequence_ids"], loss_type=module.loss_type, clip_low=module.clip_low,
                                   clip_high=module.clip_high, is_correction=module.is_correction, is_cap=module.is_cap)
    return loss_sum / module.loss_normaliser(micro_batch), logprobs.detach()


def trl_inputs(rows, pad: int, old=None) -> dict:
    """TRL's training inputs: prompts padded on the left, completions on the right."""
    prompt_lengths = [prompt_length(r) for r in rows]
    P, C = max(prompt_lengths), max(len(r) - p for r, p in zip(rows, prompt_lengths))
    prompt_ids = torch.full((len(rows), P), pad)
    prompt_mask = torch.zeros(len(rows), P, dtype=torch.long)
    completion_ids = torch.full((len(rows), C), pad)
    completion_mask = torch.zeros(len(rows), C, dtype=torch.long)
    for b, (r, p) in enumerate(zip(rows, prompt_lengths)):
        prompt_ids[b, P - p:], prompt_mask[b, P - p:] = torch.tensor(r.input_ids[:p]), 1
        c = len(r) - p
        completion_ids[b, :c], completion_mask[b, :c] = torch.tensor(r.input_ids[p:]), 1
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask,
              "advantages": torch.tensor([r.advantages[p] for r, p in zip(rows, prompt_lengths)]),
              "num_items_in_batch": completion_mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    return inputs


def compare(temperature: float) -> list[str]:
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from lit_rl.data.step_builder import build_step
    from lit_rl.modules.grpo import GRPO
    from lit_rl.modules.model_loading import load_causal_lm
    from lit_rl.sampling_process import SamplingProcess

    torch.manual_seed(0)
    model = load_causal_lm(TINY_MODEL, random_init=True, seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)  # sharp logits: the second update's ratio moves
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    rows = samples(model.config.vocab_size)

    module = GRPO(model=TINY_MODEL, max_grad_norm=None, loss_type="dapo", clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    module.model = copy.deepcopy(model)
    micro_batch = build_step(rows, micro_batch_tokens=4096, packing="packed")["micro_batches"]
    assert len(micro_batch) == 1, "the step should fit one micro-batch"
    micro_batch, process = micro_batch[0], SamplingProcess(temperature=temperature)

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, use_cpu=True, bf16=False, fp16=False, per_device_train_batch_size=16,
                            gradient_accumulation_steps=1, num_generations=8, num_iterations=2,
                            max_completion_length=32, temperature=temperature, learning_rate=LR, weight_decay=0.0,
                            loss_type="dapo", epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, beta=0.0, report_to="none")
        trainer = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=config, train_dataset=datasets.Dataset.from_list([{"prompt": "x"}] * 16),
                              processing_class=tokenizer)
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which is not run here
        trl_model = trainer.model.train()
        lit_optimizer = torch.optim.AdamW(module.model.parameters(), lr=LR, weight_decay=0.0)
        trl_optimizer = torch.optim.AdamW(trl_model.parameters(), lr=LR, weight_decay=0.0)
        report, lit_old, trl_old = [], None, None
        for update in (0, 1):
            module.model.zero_grad()
            lit_loss, lit_logprobs = lit_rl_loss(module, micro_batch, process, lit_old)
            lit_loss.backward()
            trl_model.zero_grad()
            inputs = trl_inputs(rows, tokenizer.pad_token_id, trl_old)
            trl_loss = trainer._compute_loss(trl_model, inputs)
            trl_loss.backward()
            worst, largest = 0.0, 0.0
            for a, b in zip(module.model.parameters(), trl_model.parameters()):
                worst = max(worst, (a.grad - b.grad).abs().max().item())
                largest = max(largest, b.grad.abs().max().item())
            clip = trainer._metrics["train"].get("clip_ratio/region_mean", [float("nan")])[-1]
            report.append(f"T={temperature} update {update}: loss lit-rl {lit_loss.item():+.6f} TRL "
                          f"{trl_loss.item():+.6f}; gradient max |difference| {worst:.2e} of max |entry| "
                          f"{largest:.2e} ({worst / largest:.1e}); TRL's clip_ratio/region_mean {clip:.3f}")
            if update == 0:  # the old policy of the batch: each side's own first-update logprobs
                lit_old = lit_logprobs
                with torch.no_grad():
                    trl_old = trainer._get_per_token_logps_and_entropies(
                        trl_model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
                        inputs["completion_ids"].size(1))[0]
                lit_optimizer.step()
                trl_optimizer.step()
    return report


if __name__ == "__main__":
    for t in (1.0, 0.7):
        print("\n".join(compare(t)), flush=True)
