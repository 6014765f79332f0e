"""Loading a Hugging Face causal LM by hub name or local path, or building one from a config."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_causal_lm(
    name_or_path: str,
    *,
    random_init: bool = False,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    seed: int | None = None,
) -> PreTrainedModel:
    """Pretrained weights, or (random_init) fresh weights for the architecture in the config."""
    torch_dtype = resolve_dtype(dtype)
    kwargs = {"trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if random_init:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, **kwargs)
    # from_pretrained returns eval mode and Lightning leaves it so (DESIGN.md): train explicitly.
    model.train()
    return model
