"""ModelParallelStrategy: Lightning's FSDP2 strategy, whose LoRA checkpoints leave the frozen base out.

In one process or under DDP a LoRA run's `last.ckpt` holds the adapter, its optimizer state and a
fingerprint of the frozen base, not the base: the base is loaded again from `model.init_args.model`
at resume (`LitRLModule.on_save_checkpoint`, lit_rl/lora.py). Lightning's `ModelParallelStrategy`
restores a sharded checkpoint inside `load_checkpoint`, before any module hook runs, and asks
`torch.distributed.checkpoint` for every tensor of the model, so a checkpoint without the base
would stop there with "Missing key". This subclass, which configs/strategies/fsdp2.yaml names, loads
only the trainable tensors (and the optimizer state) from a sharded checkpoint that left the frozen
ones out, or from one file that did (a LoRA run of one process or DDP, resumed under FSDP2); the
module's `on_load_checkpoint` then checks that the base it was loaded with is the one the adapter
was trained on. It also loads every one-file checkpoint (one process's or DDP's, resumed under FSDP2)
itself, naming the optimizer's state by the optimizer's own groups (`_load_one_file` says why).
Everything else is Lightning's. Lightning's own class still resumes its own sharded checkpoints, with
the whole module in every one; so does `save_distributed_checkpoint: false` (one file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME, _is_sharded_checkpoint
from lightning.pytorch.strategies import ModelParallelStrategy as LightningModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lit_rl.errors import ConfigError
from lit_rl.lora import frozen_parameter_names, has_adapter, is_adapter_key
from lit_rl.optim import regroup_checkpoint_optimizer_states

MODEL_KEY = "state_dict"  # where Lightning's sharded save puts the model's tensors


class ModelParallelStrategy(LightningModelParallelStrategy):
    @property
    def adapter_only_checkpoints(self) -> bool:
        """Whether a LoRA run's checkpoints may leave the frozen base out: sharded ones only, which
        `load_checkpoint` below restores; a one-file checkpoint goes through Lightning's loading."""
        return self._save_distributed_checkpoint

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        module = self.lightning_module
        frozen = frozen_parameter_names(module) if has_adapter(getattr(module, "model", None)) else set()
        if not _is_sharded_checkpoint(path):  # one process's or DDP's
            checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
            without_base = bool(frozen) and _leaves_out(path, checkpoint["state_dict"], frozen, module)
            return self._load_one_file(checkpoint, strict=module.strict_loading and not without_base)
        stored = _stored(path)
        if not frozen:
            if any(is_adapter_key(k) for k in stored):
                raise ConfigError("this checkpoint holds a LoRA adapter (it was written with model.lora set); "
                                  "resume it with the same model.init_args.lora")
            return super().load_checkpoint(path, weights_only=weights_only)
        if any(f"{MODEL_KEY}.{name}" in stored for name in frozen):  # the whole module: Lightning's way
            return super().load_checkpoint(path, weights_only=weights_only)
        model_state = {k: v for k, v in get_model_state_dict(self.model).items() if k not in frozen}
        dcp.load({MODEL_KEY: model_state}, checkpoint_id=path)
        missing, unexpected = self.model.load_state_dict(model_state, strict=False)
        if set(missing) - frozen or unexpected:
            raise RuntimeError(f"{path}: loading the adapter-only checkpoint left {sorted(set(missing) - frozen)[:3]} "
                               f"unset and found {unexpected[:3]} unknown")
        for index, optimizer in enumerate(self.optimizers):  # as Lightning restores them
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(optimizer_state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optimizer_state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    def _load_one_file(self, checkpoint: dict[str, Any], strict: bool) -> dict[str, Any]:
        """Lightning's loading of a one-file checkpoint (`_load_checkpoint`), but for the optimizer's
        state: a torch optimizer's `state_dict()` keys it by position, counted over the optimizer's
        parameters group after group, and Lightning's rekeying to names counts `model.parameters()`
        instead. Those differ as soon as the parameters are in two groups (`lit_rl.optim.parameter_groups`:
        the norms come last) or the frozen base is left out (a LoRA checkpoint, whose base stays as the
        model loaded it: `on_load_checkpoint` checks its fingerprint, `_leaves_out` checked the rest),
        and the state would land on the wrong tensors. Here the positions are named from the optimizer's
        own groups."""
        from lightning.fabric.strategies.model_parallel import _load_raw_module_state

        _load_raw_module_state(checkpoint.pop("state_dict"), self.model, strict=strict)
        name_of = {id(p): name for name, p in self.model.named_parameters()}
        options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True)
        regroup_checkpoint_optimizer_states(self.lightning_module, checkpoint)  # an earlier lit-rl's one group
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):  # left in, as Lightning does
            # the positions count the optimizer's parameters group after group (lit_rl.optim.parameter_groups)
            order = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=_by_name(state, order), options=options)
        return checkpoint


def _by_name(state: dict, names: list[str]) -> dict:
    """A torch optimizer's state dict keyed by position (its `state_dict()`) keyed by `names` instead:
    `names[i]` is the name of the optimizer's i-th parameter."""
    if not all(isinstance(i, int) for group in state["param_groups"] for i in group["params"]):
        return state  # already by name: written by this strategy with save_distributed_checkpoint false
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]}


def _leaves_out(path: Path, saved: dict, frozen: set[str], module) -> bool:
    """Whether the state dict `saved` of the one-file checkpoint at `path` holds every tensor of
    `module` but (some of) the frozen ones, as lit-rl's LoRA checkpoints do; a key missing beyond
    those is an error."""
    missing = set(module.state_dict()) - set(saved)
    if missing - frozen:
        raise RuntimeError(f"{path}: the checkpoint lacks {sorted(missing - frozen)[:3]} of this model")
    return bool(missing)


def _stored(path: Path) -> set[str]:
    """The names of what the sharded checkpoint at `path` holds, from the index that
    torch.distributed.checkpoint writes beside the shards (the model's as `state_dict.<name>`)."""
    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
