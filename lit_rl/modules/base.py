"""CausalLMModule: the shared base of every lit-rl algorithm.

It owns what all algorithms share and nothing else: loading the HF model in
`configure_model` (so FSDP can shard it and `__init__` stays cheap on every rank),
the injected optimizer and schedule, and one optimizer step per `training_step`.

Why manual optimization: a batch from a lit-rl datamodule is one whole optimizer
step, already split into micro-batches. Knowing every micro-batch up front lets the
loss be divided by the trained tokens of the whole step (summed over ranks), so the
loss and gradient do not depend on the micro-batch split, the gradient-accumulation
count or the number of ranks. Subclasses implement `micro_batch_loss_sum` only.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lit_rl.modules.model_loading import load_causal_lm


class CausalLMModule(L.LightningModule):
    def __init__(
        self,
        model: str = "lit_rl/assets/tiny_qwen3",
        random_init: bool = False,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        attn_implementation: str | None = "sdpa",
        tokenizer: str | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        max_grad_norm: float | None = 1.0,
        torch_compile: bool = False,
    ):
        """
        Args:
            model: HF hub name (e.g. ``Qwen/Qwen3-0.6B``) or local directory of a causal LM.
            random_init: build the architecture from the config with fresh random weights
                (the offline demo); otherwise load the pretrained weights.
            dtype: dtype the weights are loaded in: float32, bfloat16 or float16. For mixed
                precision keep float32 here and set ``trainer.precision``.
            gradient_checkpointing: recompute activations in backward to save memory.
            trust_remote_code: allow model code from the hub repository to run. Off by default.
            attn_implementation: passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``).
            tokenizer: tokenizer name or path when it differs from ``model``.
            optimizer: called with the parameters; e.g. class_path torch.optim.AdamW.
            lr_scheduler: called with the optimizer; stepped once per optimizer step.
            max_grad_norm: clip the global gradient norm to this; None disables clipping.
            torch_compile: compile the model's forward with ``torch.compile`` (dynamic shapes).
                About 1.2x faster steps for small models on CPU (docs/benchmarks.md), after a
                first step that pays the compilation (tens of seconds on a few cores).
        """
        super().__init__()
        self.model_name = model
        self.random_init = random_init
        self.dtype_name = dtype
        self.gradient_checkpointing = gradient_checkpointing
        self.trust_remote_code = trust_remote_code
        self.attn_implementation = attn_implementation
        self.tokenizer_name = tokenizer or model
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.max_grad_norm = max_grad_norm
        self.torch_compile = torch_compile
        self.model = None  # built in configure_model
        self.automatic_optimization = False
        self._last_step_end: float | None = None
        self._val_sums: list[torch.Tensor] = []
        self._compiled = False

    # ---- model -------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Load or build the HF model once; Lightning may call this more than once.
        A model set beforehand (``module.model = ...``) is kept, and still compiled if asked."""
        if self.model is None:
            self.model = load_causal_lm(
                self.model_name,
                random_init=self.random_init,
                dtype=self.dtype_name,
                trust_remote_code=self.trust_remote_code,
                attn_implementation=self.attn_implementation,
            )
            if self.gradient_checkpointing:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.torch_compile and not self._compiled:
            self.model.compile(dynamic=True)  # in place: parameter names, exports and checkpoints unchanged
            self._compiled = True

    # ---- checkpoints must match the model they are loaded into ------------------------------------
    ARCHITECTURE_KEYS = (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
    )

    def _architecture(self) -> dict:
        config = self.model.config.to_dict()
        return {k: config.get(k) for k in self.ARCHITECTURE_KEYS if k in config}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lit_rl"] = {"model": self.model_name, "architecture": self._architecture()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse, before anything is loaded or trained, a checkpoint of another architecture."""
        saved = checkpoint.get("lit_rl")
        if saved is None:
            raise ValueError("this checkpoint was not written by lit-rl (no 'lit_rl' entry); cannot resume from it")
        ours = self._architecture()
        diff = {k: (saved["architecture"].get(k), ours.get(k)) for k in ours if saved["architecture"].get(k) != ours.get(k)}
        if diff:
            lines = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in diff.items())
            raise ValueError(
                f"checkpoint is of another model ({saved['model']}) than this run's ({self.model_name}): {lines}"
            )

    def logits(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # use_cache=False: only then does transformers read packed documents from position_ids.
        out = self.model(input_ids=micro_batch["input_ids"], position_ids=micro_batch["position_ids"], use_cache=False)
        return out.logits

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"}}

    # ---- the algorithm's part ------------------------------------------------------------
    def micro_batch_loss_sum(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of the per-token loss over the micro-batch's target tokens. Subclasses define it."""
        raise NotImplementedError

    # ---- one optimizer step per batch ----------------------------------------------------
    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Collective under multi-process strategies: every rank must call it."""
        return self.trainer.strategy.reduce(value, reduce_op="sum")

    def _skip_grad_sync(self, skip: bool):
        block = getattr(self.trainer.strategy, "block_backward_sync", None)
        return block() if skip and block is not None else nullcontext()

    def _clip_and_measure_grad_norm(self) -> torch.Tensor:
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        wrapped = self.trainer.strategy.model
        if hasattr(wrapped, "clip_grad_norm_"):  # FSDP: the norm must be taken over the shards
            return wrapped.clip_grad_norm_(max_norm)
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)

    def _empty_micro_batch(self) -> dict[str, torch.Tensor]:
        """Stands in when every row of this rank's step was skipped, so gradient sync still lines up."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        return {"input_ids": ids, "position_ids": torch.arange(2, device=self.device)[None], "loss_mask": ids.bool()}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        start = self._last_step_end or time.perf_counter()
        optimizer = self.optimizers()
        micro_batches = batch["micro_batches"] or [self._empty_micro_batch()]
        local_targets = sum(int(mb["loss_mask"][:, 1:].sum()) for mb in micro_batches)
        step_targets = self._sum_over_ranks(torch.tensor(float(local_targets), device=self.device))
        # DDP/FSDP average gradients over ranks; multiplying by world_size turns that into a sum.
        scale = self.trainer.world_size / step_targets.clamp(min=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            with self._skip_grad_sync(i < len(micro_batches) - 1):
                mb_loss_sum = self.micro_batch_loss_sum(mb)
                self.manual_backward(mb_loss_sum * scale)
            loss_sum += mb_loss_sum.detach()
        grad_norm = self._clip_and_measure_grad_norm()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        loss = self._sum_over_ranks(loss_sum) / step_targets.clamp(min=1.0)
        self._last_step_end = time.perf_counter()
        metrics = {
            "train/loss": loss,
            "train/tokens": step_targets,
            "train/tokens_per_s": step_targets / max(self._last_step_end - start, 1e-9),
            "train/lr": lr,
            "train/grad_norm": grad_norm,
        }
        metrics.update({f"train/{k}": v for k, v in batch.get("stats", {}).items()})
        self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, batch_size=1)
        self.log("loss", loss, prog_bar=True, logger=False, batch_size=1)
        return loss

    # ---- validation: the same loss over a held-out split -------------------------------------
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss_sum = sum((self.micro_batch_loss_sum(mb).detach() for mb in batch["micro_batches"]), torch.zeros((), device=self.device))
        targets = sum(int(mb["loss_mask"][:, 1:].sum()) for mb in batch["micro_batches"])
        self._val_sums.append(torch.stack([loss_sum.float().cpu(), torch.tensor(float(targets))]))

    def on_validation_epoch_end(self) -> None:
        sums = torch.stack(self._val_sums).sum(0) if self._val_sums else torch.zeros(2)
        self._val_sums.clear()
        sums = self._sum_over_ranks(sums.to(self.device))
        self.log("val/loss", sums[0] / sums[1].clamp(min=1.0), batch_size=1)
