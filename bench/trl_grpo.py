"""TRL's GRPOTrainer as a method of `bench/distillation.py` (`trl_grpo`): GRPO from the same
student on the same prompts, in the order lit-rl's rollout buffer draws them, with
`examples/reverse_text/grpo.yaml`'s settings, exported every `--every` steps and scored like
lit-rl's runs.

Matched to lit-rl's GRPO: 8 prompts x 8 completions per optimizer step (`num_generations` 8,
16 per micro-batch, 4 accumulated), at most 48 new tokens, the reverse-text reward
(`ReverseTextEnv.reward`), DAPO's token mean, clip 0.2 / 0.28, no KL, AdamW at grpo.yaml's lr
without weight decay, constant rate, gradient clipping at 1.0, float32, no gradient
checkpointing. Modifiers: `iterN` sets `num_iterations` N (each generation batch feeds N
optimizer steps: lit-rl's `updates_per_batch`), `t07` samples at temperature 0.7 (lit-rl's
`+t07`), `lr1e4`, `lr3e4`, ... train at that rate instead of grpo.yaml's (`LRS`, as lit-rl's
`+lr1e4`, ...), `seedN` the seed. `use_vllm=False`: TRL generates with the trained model itself,
so its samples are exactly on-policy (lit-rl's come from a vLLM server up to one step stale).
`bench/grpo_same_samples.py` also has the child record every batch it trains on, to train
lit-rl on the same samples.
"""

from __future__ import annotations

import os
import random
import re
import sys

import yaml

from _common import REPO
from trl_child import export_and_clock, read_spec, recording, run_child, write_speed

GRPO_CONFIG = os.path.join(REPO, "examples", "reverse_text", "grpo.yaml")
MICRO = 16
#: the `lrNAME` modifiers (here and for lit-rl's methods in bench/distillation.py): AdamW at that rate
LRS = {"1e4": 1e-4, "3e4": 3e-4, "5e4": 5e-4, "1e3": 1e-3, "2e3": 2e-3, "3e3": 3e-3}


def modifiers(method: str) -> dict:
    """`iterN`, `t07`, `lrNAME` (`LRS`) and `seedN` of a `trl_grpo+...` method; unknown ones are an error."""
    out = {"num_iterations": 1, "temperature": 1.0, "seed": None, "lr": None}
    for m in method.split("+")[1:]:
        if m[:4] == "iter" and m[4:].isdigit():
            out["num_iterations"] = int(m[4:])
        elif m[:4] == "seed" and m[4:].isdigit():
            out["seed"] = int(m[4:])
        elif m == "t07":
            out["temperature"] = 0.7
        elif m[:2] == "lr" and m[2:] in LRS:
            out["lr"] = LRS[m[2:]]
        else:
            raise ValueError(f"{method}: unknown modifier {m!r} (trl_grpo takes iterN, t07, lr{'/lr'.join(LRS)}, seedN)")
    return out


def drawn_prompts(path: str, n: int, seed: int) -> list[dict]:
    """The first `n` tasks in the order lit-rl's RolloutBuffer draws them (a seeded shuffle per epoch)."""
    sys.path.insert(0, REPO)
    from lit_rl.rollouts.envs import ReverseTextEnv

    tasks = ReverseTextEnv(path=path).tasks()
    rows, epoch = [], 0
    while len(rows) < n:
        order = list(range(len(tasks)))
        random.Random(f"lit-rl:{seed}:{epoch}").shuffle(order)
        rows += [{"prompt": tasks[i]["prompt"], "text": tasks[i]["text"]} for i in order]
        epoch += 1
    return rows[:n]


def train_trl_grpo(args, method: str, root: str, record: str | None = None) -> tuple[float, dict]:
    """Run the worker in a child process; its wall time and speed. With `record`, the child also
    writes every generation batch it trained on to that JSON file (`recording`)."""
    import shutil

    if not args.steps:
        raise SystemExit("trl_grpo needs --steps (TRL has no wall-clock budget)")
    mods = modifiers(method)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    with open(GRPO_CONFIG) as f:
        example = yaml.safe_load(f)
    optimizer, data = example["model"]["init_args"]["optimizer"], example["data"]["init_args"]
    if optimizer["class_path"] != "torch.optim.AdamW" or optimizer["init_args"].get("weight_decay", 0.01) != 0.0:
        raise RuntimeError(f"{GRPO_CONFIG}: the bench gives TRL AdamW without weight decay; update it")
    tasks = data["batch_size"] // data["group_size"]
    batches = -(-args.steps // mods["num_iterations"])
    seed = example.get("seed_everything", 0) if mods["seed"] is None else mods["seed"]
    # lit-rl's task order: data.seed, else the run's seed (lit_rl/run_seed.py)
    order = data["seed"] if data.get("seed") is not None else seed
    prompts = drawn_prompts(os.path.join(REPO, data["env"]["init_args"]["path"]), batches * tasks, order)
    spec = {"student": args.student, "root": root, "steps": args.steps, "every": args.every,
            "lr": mods["lr"] or optimizer["init_args"]["lr"], "batch": data["batch_size"], "group_size": data["group_size"],
            "max_tokens": data["max_tokens"], "prompts": prompts,
            "seed": seed,
            "num_iterations": mods["num_iterations"], "temperature": mods["temperature"],
            "out": os.path.join(root, "trl_result.json"), "record": record}
    wall, result = run_child([os.path.abspath(__file__)], spec, root, method)
    with open(root + ".log") as f:  # TRL prints every step's logs: the clip fraction of each
        clip = [float(v) for v in re.findall(r"'clip_ratio/region_mean': '?([0-9.e-]+)'?", f.read())]
    result["clip_fraction"] = sum(clip) / len(clip) if clip else None
    return wall, result


def worker(spec_path: str) -> None:
    spec = read_spec(spec_path)
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from lit_rl.rollouts.envs import lcs_ratio

    tokenizer = AutoTokenizer.from_pretrained(spec["student"])
    ticks: list[float] = []
    rewards: list[list[float]] = []  # each call's: one call per generation batch

    def reverse_text_reward(prompts, completions, text, **kwargs):
        """ReverseTextEnv.reward: LCS ratio of the stripped completion against the reversed text."""
        rewards.append([lcs_ratio(c[0]["content"].strip(), t[::-1]) for c, t in zip(completions, text)])
        return rewards[-1]

    config = GRPOConfig(
        output_dir=os.path.join(spec["root"], "trl_out"), use_cpu=True, use_vllm=False, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=spec["batch"] // MICRO, num_iterations=spec["num_iterations"],
        num_generations=spec["group_size"], max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"], top_p=1.0, learning_rate=spec["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0, loss_type="dapo",
        epsilon=0.2, epsilon_high=0.28, beta=0.0, shuffle_dataset=False, max_steps=spec["steps"],
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        seed=spec["seed"],
    )
    if config.generation_batch_size != spec["batch"]:
        raise RuntimeError(f"TRL would generate {config.generation_batch_size} completions per batch, not {spec['batch']}")
    model = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=torch.float32, attn_implementation="sdpa")
    trainer = GRPOTrainer(model=model, reward_funcs=reverse_text_reward, args=config,
                          train_dataset=datasets.Dataset.from_list(spec["prompts"]), processing_class=tokenizer,
                          callbacks=[export_and_clock(spec, tokenizer, ticks)])
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    with recording(trainer, spec.get("record"), keys, lambda: {"rewards": rewards[-1]}):
        trainer.train()
    write_speed(spec, ticks)


if __name__ == "__main__":
    worker(sys.argv[1])
