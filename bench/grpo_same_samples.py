#!/usr/bin/env python
"""GRPO over a whole run from the same samples: TRL's GRPOTrainer draws them, lit-rl's GRPO
trains on exactly those, and the two models are compared at steps 10, 20 and 40.

Why: in docs/benchmarks.md lit-rl and TRL each draw their own samples, so the held-out rewards
of a pair of runs differ by the draw (fourteen seed pairs at T=0.7 put every lit-rl - TRL
difference within 1.7 standard errors of zero, some above, some below), and
`bench/grpo_update_vs_trl.py` shows one update on one batch equals TRL's. This is the whole
loop in between: forty steps of lit-rl's real training step (a Lightning Trainer, the step's
micro-batches and normaliser, its own group advantages from the rewards, gradient clipping,
AdamW, the held batch and old logprobs of `updates_per_batch`) on TRL's samples, step by step.
If lit-rl learns what TRL learns from each batch, the two models stay together to float32
rounding and so do their held-out rewards; anything the loop does differently shows as a
distance between them that grows with the steps.

    .venv/bin/python bench/grpo_same_samples.py                       # 3 settings, about 13 min on 2 cores
    .venv/bin/python bench/grpo_same_samples.py --settings t07 --steps 20

Settings (TRL's and lit-rl's, as `bench/distillation.py`'s `trl_grpo+...` and `grpo+fresh+...`):
`t1` one update per batch at temperature 1, `upb2` two updates per batch (TRL's
`num_iterations` 2), `t07` temperature 0.7; all at lr 1e-4 with grpo.yaml's other settings
(8 tasks x 8 completions, at most 48 tokens, DAPO's token mean, clip 0.2 / 0.28, AdamW without
weight decay, gradient clipping at 1.0), from the SFT demo stopped at step 40
(`bash examples/reverse_text/run_opd_demo.sh` makes it). TRL generates with the weights it
trains (`use_vllm=False`), so its samples are on-policy for lit-rl too for as long as the two
models agree; lit-rl's sampler logprobs are its own weights' at the batch's first update, at the
sampling temperature (an exact sampler: behaviour weight 1, as TRL's).

Controls, on the same recorded samples: every setting also trains lit-rl with each step split
into micro-batches of 1024 tokens, packed (`split`: float32 reordering, the floor of any
distance), and with TRL's advantages instead of its own (`TRL's advantages`: TRL divides by the
sample std + 1e-4, lit-rl by the population std + 1e-6, so lit-rl's are 1.069x TRL's in a group
of 8: what is left once that convention is taken out); `t07` also trains lit-rl on the
logprobs of the raw logits (`raw`: the temperature bias issue 21 removed).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from types import SimpleNamespace

import yaml

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import trl_grpo  # noqa: E402
from _common import REPO, STUDENT, require_checkpoint  # noqa: E402

sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples", "reverse_text"))
from exact_match import score  # noqa: E402

GRPO_CONFIG = os.path.join(REPO, "examples", "reverse_text", "grpo.yaml")
HELD_OUT = os.path.join(REPO, "examples", "reverse_text", "data", "test.jsonl")
#: each setting is a TRL method of bench/trl_grpo.py; lit-rl trains with its temperature, its
#: updates per batch (`num_iterations`) and its lr (`trl_grpo.modifiers`)
SETTINGS = {"t1": "trl_grpo+lr1e4", "upb2": "trl_grpo+iter2+lr1e4", "t07": "trl_grpo+t07+lr1e4"}


def recorded_samples(batch: dict) -> list:
    """One generation batch of TRL's as lit-rl Samples, in TRL's order (groups consecutive): the
    prompt's tokens (its mask's), then the completion's (its mask's: up to and with the EOS), the
    completion trained, the reward TRL's reward function gave it (0 where it has none: a
    distillation batch)."""
    from lit_rl.data.samples import Sample

    rows = []
    rewards = batch.get("rewards") or [0.0] * len(batch["prompt_ids"])
    for p_ids, p_mask, c_ids, c_mask, reward in zip(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                                    batch["completion_mask"], rewards):
        prompt = [t for t, m in zip(p_ids, p_mask) if m]
        completion = [t for t, m in zip(c_ids, c_mask) if m]
        ids = prompt + completion
        rows.append(Sample(input_ids=ids, loss_mask=[i >= len(prompt) for i in range(len(ids))],
                           logprobs=[0.0] * len(ids), reward=float(reward), source="policy"))
    return rows


def lit_rl_steps(batches: list[dict], group_size: int, layout: dict, trl_advantages: bool) -> tuple[list[dict], float]:
    """lit-rl's steps from TRL's batches: its own group advantages from the rewards (or TRL's,
    with `trl_advantages`), its step builder's micro-batches; and the largest ratio of lit-rl's
    advantage to TRL's (population std + 1e-6 against sample std + 1e-4: sqrt(8/7) = 1.069 for
    groups of 8)."""
    from lit_rl.data.step_builder import build_step
    from lit_rl.rollouts.advantages import with_group_advantages

    steps, ratio = [], 0.0
    for batch in batches:
        samples = recorded_samples(batch)
        if trl_advantages:
            samples = [s.with_advantage(a) for s, a in zip(samples, batch["advantages"])]
        else:
            samples = with_group_advantages(samples, group_size, scale="group")
        for s, trl in zip(samples, batch["advantages"]):
            mine = next(a for a, m in zip(s.advantages, s.loss_mask) if m)
            if abs(trl) > 1e-3:
                ratio = max(ratio, mine / trl)
        steps.append(build_step(samples, **layout))
    return steps, ratio


def train_lit_rl(student: str, steps: list[dict], updates: int, process, lr: float, loss_type: str, root: str,
                 every: int) -> None:
    """lit-rl's GRPO (grpo.yaml's settings) through a Lightning Trainer over `steps`, each fed
    `updates` times, exported by lit-rl's HFExport every `every` steps and at the last, into
    `<root>/weights/step_N`."""
    import lightning as L
    import torch

    from lit_rl.callbacks import HFExport
    from lit_rl.data.held_batch import OldLogprobs
    from lit_rl.modules.grpo import GRPO

    class Recorded(L.LightningDataModule):
        """The recorded steps, each `updates` times (its micro-batches holding one old-logprobs
        slot each, as lit_rl.data.held_batch gives them), and the sampler's settings."""

        sampling_process = process

        def train_dataloader(self):
            if updates > 1:
                for step in steps:
                    for mb in step["micro_batches"]:
                        mb["old_logprobs"] = OldLogprobs()
            fed = [step for step in steps for _ in range(updates)]
            return torch.utils.data.DataLoader(fed, batch_size=None, collate_fn=lambda x: x)

    class ExactSampler(L.Callback):
        """At a batch's first update, its sampler logprobs are the current weights' (what TRL's
        `generate` sampled from)."""

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step % updates:
                return
            with torch.no_grad():
                for mb in batch["micro_batches"]:
                    mb["logprobs"].copy_(module.target_logprobs(mb, process=process)[0])

    module = GRPO(model=student, loss_type=loss_type, updates_per_batch=updates,
                  optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0))
    trainer = L.Trainer(max_steps=len(steps) * updates, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[ExactSampler(), HFExport(every_n_steps=every)], default_root_dir=root)
    trainer.fit(module, datamodule=Recorded())


def distance(a_dir: str, b_dir: str, start_dir: str) -> tuple[float, float]:
    """The largest |difference| of any weight between two exports, and the L2 distance between
    them over the L2 distance `b` travelled from the start (tied weights counted once)."""
    import torch
    from safetensors.torch import load_file

    a, b, s = (load_file(os.path.join(d, "model.safetensors")) for d in (a_dir, b_dir, start_dir))
    if a.keys() != b.keys():
        raise RuntimeError(f"{a_dir} and {b_dir} hold different weights: {sorted(a.keys() ^ b.keys())}")
    worst, apart, moved = 0.0, 0.0, 0.0
    for name, w in b.items():
        if name not in s:
            raise RuntimeError(f"{start_dir} has no {name}")
        other = a[name].to(torch.float64)
        worst = max(worst, (other - w.to(torch.float64)).abs().max().item())
        apart += ((other - w.to(torch.float64)) ** 2).sum().item()
        moved += ((w.to(torch.float64) - s[name].to(torch.float64)) ** 2).sum().item()
    return worst, math.sqrt(apart) / max(math.sqrt(moved), 1e-30)


@functools.lru_cache(maxsize=None)
def held_out(model_dir: str, samples: int) -> dict:
    """exact_match.score's greedy and sampled held-out rewards (each TRL export scored once)."""
    return score(model_dir, HELD_OUT, samples=samples)


def compare(args, name: str, label: str, root: str, trl_root: str, export_at: list[int]) -> list[dict]:
    """lit-rl's exports under `root` against TRL's under `trl_root` at the steps `export_at`: the
    weight distances (`distance`) and both held-out rewards, one row each, printed as they come."""
    rows = []
    for step in export_at:
        trl_dir = os.path.join(trl_root, "weights", f"step_{step}")
        mine = os.path.join(root, "weights", f"step_{step}")
        worst, relative = distance(mine, trl_dir, args.student)
        rows.append({"setting": name, "run": label, "step": step, "max_abs": worst, "relative": relative,
                     **{f"lit_{k}": v for k, v in held_out(mine, args.samples).items()},
                     **{f"trl_{k}": v for k, v in held_out(trl_dir, args.samples).items()}})
        r = rows[-1]
        print(f"[{name}] {label} step {step}: weights max |lit-rl - TRL| {worst:.2e}, distance / TRL's from the start "
              f"{relative:.2e}; held-out greedy {r['lit_reward']:.3f} vs {r['trl_reward']:.3f}, sampled "
              f"{r['lit_sampled_reward']:.3f} vs {r['trl_sampled_reward']:.3f}", flush=True)
    return rows


def report(rows: list[dict], start: dict, json_path: str | None) -> None:
    """The rows as a markdown table, and with the start's rewards into `json_path` when given."""
    print("\n| setting | run | step | max abs weight difference | distance / TRL's from the start | greedy lit-rl / TRL "
          "| sampled lit-rl / TRL |\n|---|---|---:|---:|---:|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['run']} | {r['step']} | {r['max_abs']:.1e} | {r['relative']:.1e} | "
              f"{r['lit_reward']:.3f} / {r['trl_reward']:.3f} | {r['lit_sampled_reward']:.3f} / {r['trl_sampled_reward']:.3f} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"start": start, "rows": rows}, f, indent=1)


def add_run_arguments(p: argparse.ArgumentParser, out: str) -> None:
    """The student, the run's length, the held-out scoring and the outputs (both same-samples benches)."""
    p.add_argument("--student", default=STUDENT)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="compare every N optimizer steps")
    p.add_argument("--samples", type=int, default=4, help="completions per held-out prompt for the sampled reward")
    p.add_argument("--out", default=out)
    p.add_argument("--json", default=None, help="also write the rows here")


def chosen_settings(p: argparse.ArgumentParser, text: str, known) -> list[str]:
    """`--settings`, comma separated, each one of `known` (a parser error names the others)."""
    settings = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in settings if s not in known]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {list(known)}")
    return settings


def run_setting(args, name: str) -> list[dict]:
    from lit_rl.sampling_process import SamplingProcess

    method = SETTINGS[name]
    mods = trl_grpo.modifiers(method)
    out = os.path.join(os.path.abspath(args.out), name)
    trl_root = os.path.join(out, "trl")
    record = os.path.join(out, "trl_batches.json")
    os.makedirs(out, exist_ok=True)
    print(f"[{name}] TRL, {args.steps} steps ...", flush=True)
    trl_args = SimpleNamespace(student=args.student, steps=args.steps, every=args.every)
    trl_grpo.train_trl_grpo(trl_args, method, trl_root, record=record)
    with open(record) as f:
        batches = json.load(f)
    with open(GRPO_CONFIG) as f:
        example = yaml.safe_load(f)
    data, loss_type = example["data"]["init_args"], example["model"]["init_args"]["loss_type"]
    export_at = sorted({*range(args.every, args.steps + 1, args.every), args.steps})
    whole = {"micro_batch_tokens": data["micro_batch_tokens"], "packing": "padded"}
    t = mods["temperature"]
    runs = {"lit-rl": (whole, t, False), "lit-rl split": ({"micro_batch_tokens": 1024, "packing": "packed"}, t, False),
            "lit-rl, TRL's advantages": (whole, t, True)}
    if t != 1.0:
        runs["lit-rl raw"] = (whole, 1.0, False)
    rows = []
    for label, (layout, temperature, trl_advantages) in runs.items():
        steps, ratio = lit_rl_steps(batches, data["group_size"], layout, trl_advantages)
        print(f"[{name}] {label}: {len(steps)} batches of TRL's, {len(steps[0]['micro_batches'])} micro-batch(es) in the "
              f"first; lit-rl's advantage / TRL's at most {ratio:.4f}", flush=True)
        root = os.path.join(out, "".join(c if c.isalnum() else "_" for c in label))
        train_lit_rl(args.student, steps, mods["num_iterations"], SamplingProcess(temperature=temperature), mods["lr"],
                     loss_type, root, args.every)
        rows += compare(args, name, label, root, trl_root, export_at)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="t1,upb2,t07", help=f"comma separated, of {list(SETTINGS)}")
    add_run_arguments(p, "runs/grpo_same_samples")
    args = p.parse_args(argv)
    settings = chosen_settings(p, args.settings, SETTINGS)
    require_checkpoint(p, "--student", args.student)
    args.student = os.path.abspath(args.student)
    start = held_out(args.student, args.samples)
    print(f"start: held-out greedy {start['reward']:.3f}, sampled {start['sampled_reward']:.3f}", flush=True)
    report([row for name in settings for row in run_setting(args, name)], start, args.json)


if __name__ == "__main__":
    main()
