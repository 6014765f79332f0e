"""One OPD step, teacher in process, under FSDP2 with 2 CPU processes (Lightning launches rank 1 by
running this file again): `python tests/fsdp_opd_step.py TEACHER_DIR DIVERGENCE OUT_DIR`.

The student (the built-in tiny model, seed 0) and the teacher are both sharded; each rank trains
its half of 8 fixed samples (tests/test_grpo_step.rollout_samples). Rank 0 writes the updated
weights, gathered from the shards, to OUT_DIR/model.safetensors and the step's metrics to
OUT_DIR/metrics.json, for tests/test_dense_distillation.py to hold against one process.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from helpers import TINY_MODEL  # noqa: E402
from test_grpo_step import RankShare, rollout_samples, sgd  # noqa: E402

from lit_rl.modules.model_loading import load_causal_lm  # noqa: E402
from lit_rl.modules.opd import OPD  # noqa: E402


def main(teacher_dir: str, divergence: str, out: str) -> None:
    student = load_causal_lm(TINY_MODEL, random_init=True, seed=0)
    samples = rollout_samples(student, n=8)
    module = OPD(model=TINY_MODEL, optimizer=sgd, max_grad_norm=None, divergence=divergence, teacher_model=teacher_dir,
                 head_chunk_size=7)
    module.model = student
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=RankShare(samples, micro_batch_tokens=48, packing="packed"))
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()
            for k, v in module.model.state_dict().items()}
    teacher_sharded = type(module.teacher).__name__.startswith("FSDP")
    if trainer.global_rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(full, str(Path(out) / "model.safetensors"))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        (Path(out) / "metrics.json").write_text(json.dumps({**metrics, "teacher_sharded": teacher_sharded}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:4])
