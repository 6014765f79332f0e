#!/usr/bin/env python
"""On-policy distillation over a whole run from the same samples: TRL's DistillationTrainer draws
them, lit-rl's OPD trains on exactly those, and the two models are compared every 10 steps.

Why: in docs/benchmarks.md lit-rl's `reverse_kl` with the teacher in process gains 93% (greedy)
and 94% (sampled) of what TRL's DistillationTrainer (beta 1, the same divergence) gains in 40
steps, TRL ahead in each of three seeds, while lit-rl's JSD is at or above TRL's reverse KL. Each
library draws its own samples there (vLLM's sampler, transformers' `generate`), so the gap could
be in the samples or in the update. Here it can only be in the update: forty steps of lit-rl's
real training step (a Lightning Trainer, the step's micro-batches and normaliser, the chunked
divergence over the whole vocabulary at trained positions, gradient clipping, AdamW) on TRL's
recorded generation batches. If lit-rl learns what TRL learns from each batch, the two models
stay together to float32 rounding; anything the loop does differently shows as a distance
between them that grows with the steps.

    .venv/bin/python bench/opd_same_samples.py                 # reverse KL, about 6 min on 2 cores
    .venv/bin/python bench/opd_same_samples.py --settings reverse_kl,jsd --steps 20

Settings: `reverse_kl` (TRL beta 1; lit-rl `divergence: reverse_kl`) and `jsd` (TRL beta 0.5;
lit-rl `divergence: jsd`, `beta: 0.5`), both with the teacher in the trainer's process, opd.yaml's
lr and batch (64 tasks x 1 completion, at most 48 new tokens), AdamW without weight decay,
gradient clipping at 1.0, temperature 1, from the SFT demo stopped at step 40 and the SFT demo's
step 300 as the teacher (`bash examples/reverse_text/run_opd_demo.sh` makes both). TRL generates
with the weights it trains (`use_vllm=False`), so its samples are on-policy for lit-rl too for as
long as the two models agree. Control: lit-rl with each step split into packed micro-batches of
1,024 tokens (`split`: float32 reordering, the floor of any distance).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import yaml

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from _common import REPO, TEACHER, require_checkpoint  # noqa: E402
from distillation import train_trl  # noqa: E402
from grpo_same_samples import add_run_arguments, chosen_settings, compare, held_out, recorded_samples, report  # noqa: E402,E501

OPD_CONFIG = os.path.join(REPO, "examples", "reverse_text", "opd.yaml")
#: setting -> (TRL's beta, lit-rl's divergence and beta)
SETTINGS = {"reverse_kl": (1.0, "reverse_kl", 0.5), "jsd": (0.5, "jsd", 0.5)}


def train_lit_rl(student: str, teacher: str, steps: list[dict], divergence: str, beta: float, lr: float, root: str,
                 every: int) -> None:
    """lit-rl's OPD with the teacher in process through a Lightning Trainer over `steps`, exported by
    lit-rl's HFExport every `every` steps and at the last, into `<root>/weights/step_N`."""
    import lightning as L
    import torch

    from lit_rl.callbacks import HFExport
    from lit_rl.modules.opd import OPD
    from lit_rl.sampling_process import SamplingProcess

    class Recorded(L.LightningDataModule):
        """The recorded steps, once each, sampled at temperature 1 (TRL's)."""

        sampling_process = SamplingProcess(temperature=1.0)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(steps, batch_size=None, collate_fn=lambda x: x)

    module = OPD(model=student, divergence=divergence, beta=beta, teacher_model=teacher, log_entropy=False,
                 optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0))
    trainer = L.Trainer(max_steps=len(steps), accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[HFExport(every_n_steps=every)], default_root_dir=root)
    trainer.fit(module, datamodule=Recorded())


def run_setting(args, name: str) -> list[dict]:
    from lit_rl.data.step_builder import build_step

    trl_beta, divergence, beta = SETTINGS[name]
    out = os.path.join(os.path.abspath(args.out), name)
    trl_root = os.path.join(out, "trl")
    record = os.path.join(out, "trl_batches.json")
    os.makedirs(out, exist_ok=True)
    print(f"[{name}] TRL, {args.steps} steps ...", flush=True)
    trl_args = SimpleNamespace(student=args.student, teacher=args.teacher, steps=args.steps, every=args.every)
    train_trl(trl_args, trl_root, record=record, beta=trl_beta)
    with open(record) as f:
        batches = json.load(f)
    with open(OPD_CONFIG) as f:
        example = yaml.safe_load(f)
    data, lr = example["data"]["init_args"], example["model"]["init_args"]["optimizer"]["init_args"]["lr"]
    export_at = sorted({*range(args.every, args.steps + 1, args.every), args.steps})
    layouts = {"lit-rl": {"micro_batch_tokens": data["micro_batch_tokens"], "packing": data.get("packing", "padded")},
               "lit-rl split": {"micro_batch_tokens": 1024, "packing": "packed"}}
    rows = []
    for label, layout in layouts.items():
        steps = [build_step(recorded_samples(batch), **layout) for batch in batches]
        print(f"[{name}] {label}: {len(steps)} batches of TRL's ({sum(len(b['prompt_ids']) for b in batches[:1])} "
              f"completions in the first), {len(steps[0]['micro_batches'])} micro-batch(es) in the first", flush=True)
        root = os.path.join(out, "".join(c if c.isalnum() else "_" for c in label))
        train_lit_rl(args.student, args.teacher, steps, divergence, beta, lr, root, args.every)
        rows += compare(args, name, label, root, trl_root, export_at)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="reverse_kl", help=f"comma separated, of {list(SETTINGS)}")
    p.add_argument("--teacher", default=TEACHER)
    add_run_arguments(p, "runs/opd_same_samples")
    args = p.parse_args(argv)
    settings = chosen_settings(p, args.settings, SETTINGS)
    for flag, path in (("--student", args.student), ("--teacher", args.teacher)):
        require_checkpoint(p, flag, path)
    args.student, args.teacher = os.path.abspath(args.student), os.path.abspath(args.teacher)
    start = held_out(args.student, args.samples)
    print(f"start: held-out greedy {start['reward']:.3f}, sampled {start['sampled_reward']:.3f}", flush=True)
    report([row for name in settings for row in run_setting(args, name)], start, args.json)


if __name__ == "__main__":
    main()
