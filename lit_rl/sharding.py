"""FSDP2 sharding of a Hugging Face causal LM, applied in `configure_model`.

Lightning's `ModelParallelStrategy` leaves parallelisation to the module: it sets up
the processes and a device mesh, calls `configure_model`, and expects the module to
apply `fully_shard` there. lit-rl does it here, the FSDP2 way: each decoder layer is
its own unit (its full weights exist only while it runs forward or backward), the
rest (embeddings, final norm, output head) is the root unit. The layer classes come
from the model's `_no_split_modules` (what transformers itself keeps on one device),
so any architecture works without a table of class names here.

lit-rl applies no tensor parallelism, so it shards over every rank of the strategy's
mesh, whatever its `data_parallel_size` x `tensor_parallel_size` split (Lightning's
defaults make that nodes x devices per node).

Why a registered forward method: the training path runs the decoder body and then
applies the output head only at trained positions (`lit_rl.chunked_head`); it never
calls the root module's `forward`. FSDP2 gathers the root unit's parameters only in
a forward it knows of, so the body call is registered as one (`body`), and the
head's weight is read after it, while the root's parameters are still gathered
(FSDP2 keeps the root unsharded from forward until backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

MIXED_PRECISION = {"bfloat16": torch.bfloat16, "float16": torch.float16}
BODY_METHOD = "lit_rl_body"  # the body's call, registered on the root as an FSDP forward method


@dataclass
class FSDP2Options:
    """How the model is sharded under ``ModelParallelStrategy`` (other strategies refuse non-defaults).

    Args:
        mixed_precision: dtype the gathered parameters compute in (``bfloat16``, ``float16``);
            gradients are reduced and the optimizer steps in the weights' own dtype (float32).
            None: compute in the weights' dtype.
        cpu_offload: keep the parameter shards, gradients and optimizer state in CPU memory
            (the optimizer steps on CPU); for models that do not fit otherwise, at a large cost in speed.
        reshard_after_forward: free each layer's gathered weights after its forward and gather them
            again for backward (less memory, one more all-gather per layer).
    """

    mixed_precision: str | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool = True

    def __post_init__(self):
        if self.mixed_precision not in (None, *MIXED_PRECISION):
            raise ValueError(f"model.sharding.mixed_precision must be one of {', '.join(MIXED_PRECISION)} or null, "
                             f"got {self.mixed_precision!r}")


def decoder_layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes of `model`'s modules named in its `_no_split_modules`: its decoder layers."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"cannot shard {type(model).__name__}: it names no decoder-layer class in `_no_split_modules` "
            f"({sorted(names) or 'empty'}) that occurs in the model"
        )
    return tuple(classes)


def fsdp2_mesh(device_mesh):
    """The strategy's device mesh as one dimension over all ranks (lit-rl shards over all of them)."""
    return device_mesh if device_mesh.ndim == 1 else device_mesh._flatten("lit_rl_fsdp")


def apply_fsdp2(model: nn.Module, device_mesh, options: FSDP2Options | None = None) -> nn.Module:
    """Shard `model` in place: each decoder layer, then the root. Call it on every rank (the
    shards are cut from the full weights each rank holds, which must be equal on all ranks)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    options = options or FSDP2Options()
    kwargs = {"mesh": fsdp2_mesh(device_mesh)}
    if options.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=MIXED_PRECISION[options.mixed_precision], reduce_dtype=torch.float32)
    if options.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    check_same_weights(model, kwargs["mesh"])
    layer_classes = decoder_layer_classes(model)
    for module in list(model.modules()):
        if isinstance(module, layer_classes):
            fully_shard(module, reshard_after_forward=options.reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    setattr(model, BODY_METHOD, model.base_model.__call__)
    register_fsdp_forward_method(model, BODY_METHOD)
    return model


def check_same_weights(model: nn.Module, mesh) -> None:
    """Collective: refuse to shard weights that differ between ranks. Each rank keeps its own
    slice of its own copy, so ranks that built different random weights would train a silent
    mix (DDP broadcasts rank 0's weights; FSDP2 does not). Compares a checksum per parameter."""
    import torch.distributed as dist

    if mesh.size() == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()]).to(device)  # [P]
    high, low = sums.clone(), -sums
    group = mesh.get_group()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MAX, group=group)
    if not torch.allclose(high, -low, rtol=1e-9, atol=1e-9):
        raise ValueError("the ranks built different weights, which FSDP2 would shard into a mix: with "
                         "model.random_init, set seed_everything to an integer so every rank builds the same")


def body(model: nn.Module):
    """The decoder body's call: through the root's FSDP hooks when sharded, else the body itself."""
    return getattr(model, BODY_METHOD, None) or model.base_model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


class DecoderLayerPolicy(ModuleWrapPolicy):
    """FSDP1 auto-wrap policy (Lightning's ``FSDPStrategy(auto_wrap_policy=...)``): each decoder
    layer of the Hugging Face model inside the wrapped module is a unit, its classes found as for
    FSDP2 when FSDP applies the policy to the module (a ModuleWrapPolicy, as Lightning expects)."""

    def __init__(self):
        super().__init__(set())

    def _run_policy(self, root_module: nn.Module, ignored_modules, root_kwargs):
        self._module_classes = set(decoder_layer_classes(hf_model_in(root_module)))
        self._module_classes_str = str(self._module_classes)
        return super()._run_policy(root_module, ignored_modules, root_kwargs)


def hf_model_in(module: nn.Module) -> nn.Module:
    """The outermost Hugging Face model in `module` (a LightningModule, say)."""
    from transformers import PreTrainedModel

    for m in module.modules():
        if isinstance(m, PreTrainedModel):
            return m
    raise ValueError(f"no Hugging Face model (PreTrainedModel) found in {type(module).__name__}")
