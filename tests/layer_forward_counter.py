"""A test-only callback that counts, per rank, how often each decoder layer runs forward with
gradients enabled, next to the embedding (which runs once per forward of the model).

With activation checkpointing on, every layer runs once more in backward to recompute its
activations: twice the embedding's count. That is the evidence a test needs that checkpointing
really happens, beyond a flag being set (and inside a CLI process it can only be observed there).
Pass it as ``--trainer.callbacks+=layer_forward_counter.CountLayerForwards
--trainer.callbacks.out_dir DIR`` with tests/ on PYTHONPATH; it writes DIR/rank<N>.json.
"""

import json
import os

import lightning as L
import torch


class CountLayerForwards(L.Callback):
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.counts: dict[str, int] = {}

    def _counter(self, name: str):
        def pre_hook(module, args):
            if torch.is_grad_enabled():  # training forwards and their recomputation, not no-grad probes
                self.counts[name] = self.counts.get(name, 0) + 1
        return pre_hook

    def on_train_start(self, trainer, pl_module):
        decoder = pl_module.model.base_model  # after sharding: the same modules, with FSDP's hooks
        decoder.embed_tokens.register_forward_pre_hook(self._counter("embed_tokens"))
        for i, layer in enumerate(decoder.layers):
            layer.register_forward_pre_hook(self._counter(f"layers.{i}"))

    def on_train_end(self, trainer, pl_module):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.counts, f)
