"""LoRA adapters through `peft`: options, injection, and the adapter's files.

Why `peft.inject_adapter_in_model` and not `get_peft_model`: injection replaces the targeted
linear layers in place and returns the same Hugging Face model, so everything lit-rl does with
it (the decoder body and the chunked head, FSDP2 units, gradient checkpointing, compile) is
unchanged; `get_peft_model` would wrap it in a `PeftModel` whose `base_model` is not the body.
Only the adapter's weights require gradients, so only they reach the optimizer.

The adapter is saved in PEFT's own format (`adapter_config.json`, `adapter_model.safetensors`
with `base_model.model.` keys), which `peft`, transformers (`from_pretrained` of the directory)
and vLLM (`--enable-lora`, `/v1/load_lora_adapter`) all read. The frozen base weights are written
once per run (`weights/base`), for the policy's server and as the adapter's base.

Lightning's `last.ckpt` of a LoRA run holds the adapter, its optimizer state and a fingerprint
of the frozen base, not the base itself (`CausalLMModule.on_save_checkpoint`): the base is
loaded again from `model.init_args.model` at resume, and the fingerprint refuses a base that is
not the one the adapter was trained on. For an 8B model that is a few MB instead of 16 GB a save.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lit_rl.errors import ConfigError
from lit_rl.server_options import with_server_args

PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before every key
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# vLLM's --max-lora-rank takes only these (vllm/config/lora.py, MaxLoRARanks, checked on 0.32)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAOptions:
    """A LoRA adapter on the model's linear layers (``model.init_args.lora``).

    Args:
        rank: the adapter's rank r.
        alpha: scale numerator: the update is ``alpha / rank * B @ A``.
        dropout: dropout on the adapter's input while training.
        target_modules: ``all-linear`` (every linear layer but the output head) or module names,
            matched as peft matches them (a name's last parts, e.g. ``q_proj``).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"

    def __post_init__(self):
        problems = []
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:  # True is an int
            problems.append(f"rank must be an int >= 1, got {self.rank!r}")
        elif self.rank > VLLM_MAX_LORA_RANKS[-1]:
            problems.append(f"rank {self.rank} is above vLLM's largest --max-lora-rank ({VLLM_MAX_LORA_RANKS[-1]})")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            problems.append(f"alpha must be a finite number > 0, got {self.alpha!r}")  # inf: every update infinite
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules or (isinstance(self.target_modules, str) and self.target_modules != "all-linear"):
            problems.append(f"target_modules must be 'all-linear' or a list of module names, got {self.target_modules!r}")
        if problems:
            raise ValueError("model.lora: " + "; ".join(problems))

    @property
    def server_max_rank(self) -> int:
        return server_max_rank(self.rank)

    def peft_config(self):
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          bias="none")


def adapter_options(options: LoRAOptions) -> dict:
    """What of the options decides what the adapter's weights mean (its shapes, where it applies
    and its scale alpha / r), as a checkpoint keeps it; dropout only changes how it trains."""
    targets = options.target_modules if isinstance(options.target_modules, str) else sorted(options.target_modules)
    return {"rank": options.rank, "alpha": float(options.alpha), "target_modules": targets}


def server_max_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds an adapter of this rank."""
    return next(r for r in VLLM_MAX_LORA_RANKS if r >= rank)


def lora_server_options(options: dict, rank: int) -> dict:
    """`VLLMServer` options with vLLM's LoRA support: adapters up to `rank`, one at a time,
    loadable at run time (`/v1/load_lora_adapter`: the policy's sync, the evaluator's steps)."""
    options = with_server_args(options, ["--enable-lora", "--max-lora-rank", str(server_max_rank(rank)), "--max-loras", "1"])
    return {**options, "env": {**options.get("env", {}), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}}


def adapter_base(adapter: str | Path) -> tuple[str, int]:
    """The base model an adapter directory applies to (its `base_model_name_or_path`) and its rank."""
    config = json.loads((Path(adapter) / ADAPTER_CONFIG).read_text())
    return config["base_model_name_or_path"], int(config["r"])


def add_adapter(model: nn.Module, options: LoRAOptions) -> nn.Module:
    """Inject the adapter into `model` in place (the base frozen, the adapter trainable)."""
    from peft import inject_adapter_in_model

    try:
        model = inject_adapter_in_model(options.peft_config(), model)
    except ValueError as e:  # peft's NoMatchingPeftModuleError is a ValueError
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"model.lora.target_modules {options.target_modules!r}: {e} The model's linear layers "
                          f"are named: {', '.join(linear)}") from e
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "lora_A"):
        # the losses apply the head's weight themselves, at the trained positions only, in chunks: an
        # adapter on it would get no gradient (its B stays 0) and the run would train nothing there
        name = next(n for n, m in model.named_modules() if m is head)
        raise ConfigError(f"model.lora.target_modules {options.target_modules!r} takes in the output head ({name}), "
                          "which lit-rl's losses apply themselves (at trained positions, in chunks): an adapter there "
                          "would not train; leave it out")
    return model


def has_adapter(model: nn.Module | None) -> bool:
    return model is not None and bool(getattr(model, "peft_config", None))


@contextlib.contextmanager
def adapter_disabled(model: nn.Module):
    """The base model's outputs inside the block (GRPO's reference without a copy of the model)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def is_adapter_key(name: str) -> bool:
    return ".lora_" in name


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's full tensors in PEFT's file format (CPU). Collective under FSDP2: every rank
    gathers the adapter's parameters in the same order; only these, never the base."""
    state = {}
    for name, param in model.named_parameters():
        if is_adapter_key(name):
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            state[name] = full.detach().cpu().contiguous()
    return peft_file_state(model, state)


def peft_file_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's entries of a (full) state dict, renamed as PEFT's files name them."""
    from peft import get_peft_model_state_dict

    picked = get_peft_model_state_dict(model, state_dict={k: v for k, v in state.items() if is_adapter_key(k)})
    return {PEFT_PREFIX + k: v for k, v in picked.items()}


def base_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base weights of a full state dict under the plain model's names."""
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter_key(k)}


def merged_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's weights with the adapter merged in: W + alpha/r * B @ A per target layer,
    transposed where the base stores its weight as (in, out) (GPT-2's Conv1D, PEFT's
    `fan_in_fan_out`) and for an embedding (PEFT's `lora_embedding_A/B`), as PEFT merges. From a
    gathered state dict (the model itself may be sharded).

    Departs from PEFT's `merge_and_unload` for an adapted embedding tied to the output head: the
    adapter changes the embedding's lookups only, never the head (the trained model's head is the
    base weight), so the head keeps the base weight here and the two are no longer one tensor
    (`unties`: the checkpoint must be written untied). PEFT merges into the shared tensor, which
    moves the head too: the tiny Qwen3's logits were 2.6 off the trained model's."""
    options = model.peft_config["default"]
    scale = options.lora_alpha / options.r
    merged = base_state(state)
    for name in state:
        if name.endswith(".lora_A.default.weight"):
            layer = name[: -len(".lora_A.default.weight")]
            a, b = state[name].double(), state[f"{layer}.lora_B.default.weight"].double()
            delta = b @ a  # (out, in)
            if getattr(_submodule(model, layer), "fan_in_fan_out", False):
                delta = delta.T
        elif name.endswith(".lora_embedding_A.default"):
            layer = name[: -len(".lora_embedding_A.default")]
            a, b = state[name].double(), state[f"{layer}.lora_embedding_B.default"].double()
            delta = (b @ a).T  # (num_embeddings, dim), as the embedding's weight
        else:
            continue
        weight = merged[f"{layer}.weight"]
        merged[f"{layer}.weight"] = (weight.double() + scale * delta).to(weight.dtype)  # a tied head keeps `weight`
    return merged


def unties(model: nn.Module, state: dict[str, torch.Tensor]) -> bool:
    """Whether `state` (the plain model's names) holds different values under two names of one
    tied parameter: `merged_state` of an adapted embedding that the head shares."""
    groups: dict[int, list[str]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        plain = full.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        if plain in state:
            groups.setdefault(id(p), []).append(plain)
    return any(state[name] is not state[names[0]] and not torch.equal(state[name], state[names[0]])
               for names in groups.values() for name in names[1:])


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    """The module a state-dict prefix names, in `model` or under PEFT's wrapper of it."""
    for prefix in ("", "base_model.model."):
        try:
            return model.get_submodule(prefix + name)
        except AttributeError:
            continue
    return None


def write_adapter(model: nn.Module, state: dict[str, torch.Tensor], directory: Path, base: str) -> None:
    """PEFT's two files in `directory`; `base` is the base model they apply to (a path or hub name)."""
    from safetensors.torch import save_file

    config = copy.deepcopy(model.peft_config["default"])
    config.base_model_name_or_path = base
    config.save_pretrained(str(directory))  # PEFT's own serialisation of its config
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def frozen_parameter_names(module: nn.Module) -> set[str]:
    """The state-dict names of `module`'s frozen parameters, tied ones under each of their names
    (a tied head is in a state dict twice, as the embedding and as the head)."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def base_fingerprint(module: nn.Module) -> dict[str, list]:
    """Per frozen parameter: dtype, element count, float64 sum and L2 norm. Cheap to keep in a
    checkpoint and enough to tell two bases apart; summed in chunks so that no float64 copy of a
    whole embedding matrix is made. A sharded parameter (FSDP2's DTensor) is gathered one tensor
    at a time, on every rank (a collective), so that its fingerprint is the whole tensor's."""
    from torch.distributed.tensor import DTensor

    out = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.requires_grad:
                continue
            whole = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            total = squares = 0.0
            for chunk in whole.reshape(-1).split(1 << 22):
                wide = chunk.double()
                total += wide.sum().item()
                squares += wide.square().sum().item()
            out[name] = [str(p.dtype).removeprefix("torch."), p.numel(), total, math.sqrt(squares)]
    return out


def base_difference(saved: dict[str, list], ours: dict[str, list]) -> str | None:
    """How the base a checkpoint's adapter was trained on differs from this run's (None: the same).
    The sums may differ in their last bits when summed on another device; anything past 1e-9 of
    the tensor's size is another base."""
    if saved.keys() != ours.keys():
        only_saved, only_ours = sorted(saved.keys() - ours.keys()), sorted(ours.keys() - saved.keys())
        return f"frozen tensors only in the checkpoint: {only_saved[:3]}; only in this model: {only_ours[:3]}"
    for name, (dtype, numel, total, norm) in saved.items():
        our_dtype, our_numel, our_total, our_norm = ours[name]
        if (dtype, numel) != (our_dtype, our_numel):
            return f"{name} is {dtype} with {numel} elements in the checkpoint, {our_dtype} with {our_numel} here"
        tolerance = 1e-9 * max(norm, our_norm, 1e-30)
        if abs(norm - our_norm) > tolerance or abs(total - our_total) > tolerance * math.sqrt(numel):
            return f"{name} differs (L2 norm {norm:.9g} in the checkpoint, {our_norm:.9g} here)"
    return None
