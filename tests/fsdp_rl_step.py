"""RL steps under FSDP2 with 2 CPU processes (Lightning launches rank 1 by running this file again):
`python tests/fsdp_rl_step.py ALGORITHM OPTIONS_JSON OUT_DIR [STEPS]`, ALGORITHM `OPD` or `GRPO`,
OPTIONS_JSON its keyword arguments (e.g. `{"divergence": "jsd", "teacher_model": DIR}`; `lr`: SGD's,
default 1).

The policy (the built-in tiny model, seed 0) and any frozen model beside it (OPD's teacher in
process, GRPO's reference) are sharded; each rank trains its half of 8 fixed samples
(tests/test_grpo_step.rollout_samples), STEPS times (default 1). Rank 0 writes the updated
weights, gathered from the shards, to OUT_DIR/model.safetensors and the last step's metrics to
OUT_DIR/metrics.json, for the tests to hold against one process.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from helpers import TINY_MODEL  # noqa: E402
from test_grpo_step import RankShare, rollout_samples  # noqa: E402
from test_mixed_step import mixed_share  # noqa: E402

from lit_rl.modules.model_loading import load_causal_lm  # noqa: E402
from lit_rl.modules import GRPO, OPD  # noqa: E402


def main(algorithm: str, options: str, out: str, steps: str = "1") -> None:
    student = load_causal_lm(TINY_MODEL, random_init=True, seed=0)
    samples = rollout_samples(student, n=8)
    options = json.loads(options)
    lr = options.pop("lr", 1.0)  # SGD's; 1 by default, as the one-process references in the tests
    replay = options.pop("replay", 0)  # that many replay rows beside the rollouts: a mixed step (`mixed_share`)
    module = {"OPD": OPD, "GRPO": GRPO}[algorithm](model=TINY_MODEL, optimizer=lambda p: torch.optim.SGD(p, lr=lr),
                                                   max_grad_norm=None, head_chunk_size=7, **options)
    module.model = student
    trainer = L.Trainer(max_steps=int(steps), accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    data = (mixed_share(samples, replay) if replay else
            RankShare(samples, micro_batch_tokens=48, packing="packed", steps=int(steps)))
    trainer.fit(module, datamodule=data)
    # One write per line, each rank's whole: under PYTHONUNBUFFERED print's text and newline are two
    # writes, and the two ranks' lines once interleaved in the shared pipe ("rank 0 parts: ...rank 1 parts: ...").
    os.write(1, f"rank {trainer.global_rank} parts: {data.parts_per_micro_batch if replay else None}\n".encode())
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()
            for k, v in module.model.state_dict().items()}
    frozen = module.teacher if algorithm == "OPD" else module._reference
    frozen_sharded = type(frozen).__name__.startswith("FSDP")
    if trainer.global_rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(full, str(Path(out) / "model.safetensors"))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        (Path(out) / "metrics.json").write_text(json.dumps({**metrics, "frozen_sharded": frozen_sharded}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:5])
