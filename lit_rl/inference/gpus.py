"""Split one node's GPUs between training and a lit-rl-managed vLLM server.

    plan = plan_gpus(8, num_infer_gpus=4, tensor_parallel_size=2)
    plan.train_devices   # [0, 1, 2, 3]   -> Trainer(devices=...)
    plan.infer_devices   # ["4", "5", "6", "7"] -> VLLMServer(devices=...), its CUDA_VISIBLE_DEVICES
    plan.tensor_parallel_size, plan.data_parallel_size   # 2, 2

Training takes the first GPUs, inference the last `num_infer_gpus`. Inference GPUs beyond one
tensor-parallel group become vLLM data-parallel ranks (one engine per group behind the same
server), never idle cards. A pure function: nothing here touches CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GPUPlan:
    train_devices: list[int]  # indices into this process's visible GPUs, for Trainer(devices=...)
    infer_devices: list[str]  # ids for the server's CUDA_VISIBLE_DEVICES (as this process sees them named)
    tensor_parallel_size: int
    data_parallel_size: int

    def server_kwargs(self) -> dict:
        """Keyword arguments for `VLLMServer(model, **plan.server_kwargs())`."""
        return {"devices": self.infer_devices, "tensor_parallel_size": self.tensor_parallel_size,
                "data_parallel_size": self.data_parallel_size}


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES names them (ids or UUIDs), else 0..count-1."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_gpus(gpus: int | Sequence[int | str], num_infer_gpus: int, tensor_parallel_size: int = 1) -> GPUPlan:
    """Training on the first GPUs, vLLM on the last `num_infer_gpus` with tp x dp = num_infer_gpus.

    Args:
        gpus: the node's GPU count, or the visible GPU ids (e.g. `visible_gpus()`).
        num_infer_gpus: GPUs for the inference server; the rest train.
        tensor_parallel_size: GPUs per vLLM engine; must divide num_infer_gpus.
    """
    ids = [str(i) for i in range(gpus)] if isinstance(gpus, int) else [str(g) for g in gpus]
    problems = []
    if not ids:
        problems.append("no GPUs are visible (a lit-rl-managed server on one node needs GPUs; or give base_url)")
    if len(set(ids)) != len(ids):
        problems.append(f"GPU ids repeat: {ids}")
    if tensor_parallel_size < 1:
        problems.append(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if num_infer_gpus < 1:
        problems.append(f"num_infer_gpus must be >= 1, got {num_infer_gpus} (to use a server you run elsewhere, give base_url)")
    elif ids and num_infer_gpus >= len(ids):
        problems.append(f"num_infer_gpus={num_infer_gpus} leaves no GPU for training out of {len(ids)}")
    if tensor_parallel_size >= 1 and num_infer_gpus >= 1 and num_infer_gpus % tensor_parallel_size:
        problems.append(
            f"num_infer_gpus={num_infer_gpus} is not a multiple of tensor_parallel_size={tensor_parallel_size} "
            f"(the rest would sit idle); use {num_infer_gpus - num_infer_gpus % tensor_parallel_size or tensor_parallel_size} "
            "or change tensor_parallel_size"
        )
    if problems:
        raise ValueError("cannot split GPUs between training and inference: " + "; ".join(problems))
    n_train = len(ids) - num_infer_gpus
    return GPUPlan(
        train_devices=list(range(n_train)),
        infer_devices=ids[n_train:],
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=num_infer_gpus // tensor_parallel_size,
    )
