"""Loading a Hugging Face causal LM by hub name or local path, or building one from a config."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lit_rl.model_names import not_loadable, resolve_model_name

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
    """Pretrained weights, or (random_init) fresh weights for the architecture in the config.
    `name_or_path` may name a built-in model (``lit-rl:tiny_qwen3``, lit_rl/model_names.py)."""
    path = resolve_model_name(name_or_path)
    torch_dtype = resolve_dtype(dtype)
    kwargs = {"trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if random_init:
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except OSError as e:
            raise not_loadable(name_or_path, "model config", e) from e
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, **kwargs)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
        except OSError as e:
            raise not_loadable(name_or_path, "model", e) from e
    # from_pretrained returns eval mode and Lightning leaves it so (DESIGN.md): train explicitly.
    model.train()
    return model


def turn_off_dropout(model: torch.nn.Module) -> int:
    """Turn off every dropout of `model` in training mode; returns how many were above 0.

    Each `nn.Dropout`-like module gets p 0, and each float attribute of a module named like
    `*dropout*` is set to 0: that is the probability HF attention passes to
    `scaled_dot_product_attention` while training (Qwen3's and Llama's `attention_dropout`, Falcon's
    `hidden_dropout`), which no dropout module sees. The config is left as it is, so exported
    checkpoints keep the model's own values."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            count += module.p > 0
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                count += value > 0
                setattr(module, name, 0.0)
    return int(count)
