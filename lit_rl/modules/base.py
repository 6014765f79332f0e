"""CausalLMModule: the shared base of every lit-rl algorithm.

It owns what all algorithms share and nothing else: loading the HF model in
`configure_model` (so FSDP can shard it and `__init__` stays cheap on every rank),
the injected optimizer and schedule, one optimizer step per `training_step` (in named
parts, `lit_rl/modules/step.py`), and the output head applied only where a token is trained.

Why manual optimization: a batch from a lit-rl datamodule is one whole optimizer
step, already split into micro-batches. Knowing every micro-batch up front lets the
loss be divided by the trained tokens of the whole step (summed over ranks), so the
loss and gradient do not depend on the micro-batch split, the gradient-accumulation
count or the number of ranks. Subclasses implement `micro_batch_loss_sum` (and
`loss_normaliser` when theirs is not the trained tokens: sequences for GRPO, say).

Why the head is not the model's own: with a real vocabulary (Qwen3: 151,936 rows) the
logits of every position are the largest tensor of the step, yet losses need them only
where the next token is trained. `target_cross_entropy_sum` and `target_logprobs` run
the decoder body, pick the hidden states of trained positions and apply the head to
them in chunks (`lit_rl.chunked_head`), so nothing of shape `[all positions, vocab]` is
built. A model whose forward does more to its logits than the head (soft-capping,
scaling) is detected on the first micro-batch and keeps the full-logits path.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info

from lit_rl.errors import ConfigError
from lit_rl.chunked_head import DEFAULT_CHUNK_SIZE, selected_cross_entropy_sum, selected_token_logprobs
from lit_rl.lora import (
    LoRAOptions,
    adapter_options,
    add_adapter,
    base_difference,
    base_fingerprint,
    frozen_parameter_names,
    has_adapter,
    is_adapter_key,
)
from lit_rl.losses import masked_cross_entropy_sum, shifted_token_logprobs, token_entropy
from lit_rl.modules.model_loading import DTYPES, load_causal_lm, turn_off_dropout
from lit_rl.modules.step import TrainingStep, trained_tokens
from lit_rl.optim import build_lr_scheduler, config_values_of, parameter_groups, regroup_checkpoint_optimizer_states, trainer_total_steps
from lit_rl.sampling_process import RAW, SamplingProcess
from lit_rl.sharding import FSDP2Options, apply_fsdp2, body, is_sharded

log = logging.getLogger(__name__)


class CausalLMModule(TrainingStep, L.LightningModule):
    # what the loss does with the tokens: "cross_entropy" (any source), "policy_gradient" and
    # "distillation" (the policy's own samples only); data modules check it against their source
    loss_kind: str | None = None

    def __init__(
        self,
        model: str = "lit-rl:tiny_qwen3",
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
        head_chunk_size: int = DEFAULT_CHUNK_SIZE,
        sharding: FSDP2Options | None = None,
        lora: LoRAOptions | None = None,
        disable_dropout: bool = False,
    ):
        """
        Args:
            model: HF hub name (e.g. ``Qwen/Qwen3-0.6B``), local directory of a causal LM, or a
                built-in model (``lit-rl:tiny_qwen3``, found from any directory).
            random_init: build the architecture from the config with fresh random weights
                (the offline demo); otherwise load the pretrained weights.
            dtype: dtype the weights are loaded in: float32, bfloat16 or float16. For mixed
                precision keep float32 here and set ``trainer.precision``.
            gradient_checkpointing: recompute activations in backward to save memory.
            trust_remote_code: allow model code from the hub repository to run. Off by default.
            attn_implementation: passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``).
            tokenizer: tokenizer name or path when it differs from ``model``.
            optimizer: called with the trained parameters in two groups, the second (biases and norm
                weights) with ``weight_decay`` 0 (`lit_rl.optim.parameter_groups`); e.g. class_path torch.optim.AdamW.
            lr_scheduler: called with the optimizer; stepped once per optimizer step. e.g. class_path
                lit_rl.optim.LRSchedule, whose length defaults to the trainer's optimizer steps.
            max_grad_norm: clip the global gradient norm to this; None disables clipping.
            torch_compile: compile the model's forward with ``torch.compile`` (dynamic shapes).
                About 1.2x faster steps for small models on CPU (docs/benchmarks.md), after a
                first step that pays the compilation (tens of seconds on a few cores).
            head_chunk_size: trained positions whose logits are computed at once. The loss's
                memory is ``head_chunk_size x vocabulary`` floats (1024 x 151,936 x 4 bytes =
                0.6 GB for Qwen3), whatever the number of trained tokens.
            sharding: FSDP2 options (mixed precision, CPU offload), used when ``trainer.strategy`` is
                Lightning's ``ModelParallelStrategy`` (configs/strategies/fsdp2.yaml; lit_rl/sharding.py); a
                value other than the defaults is refused under any other strategy, which would ignore it.
            lora: train a LoRA adapter (`lit_rl.lora.LoRAOptions`: rank, alpha, dropout, target modules)
                instead of every weight: the base is frozen, only the adapter is in the optimizer, and RL
                weight syncs send only the adapter to vLLM (docs/lora.md). None: full fine-tuning.
            disable_dropout: train with the model's dropout off (`turn_off_dropout` in
                lit_rl/modules/model_loading.py). Off for SFT, where dropout regularises as the model's
                authors set it; GRPO and OPD turn it on by default, as TRL's trainers do: their losses
                compare the trainer's log-probabilities with those of the sampler, which runs without
                dropout, so dropout would add noise to every ratio and bias the KL terms. The exported
                config keeps the model's dropout values.
        """
        if head_chunk_size < 1:
            raise ValueError(f"model.head_chunk_size must be >= 1, got {head_chunk_size}")
        if dtype not in DTYPES:  # checked here: loading it is after the data's set-up, a traceback there
            raise ValueError(f"model.init_args.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:  # 0 would zero every step, a negative one ascend
            raise ValueError(f"model.max_grad_norm must be > 0, or null to disable clipping (HF Trainer's 0), "
                             f"got {max_grad_norm}")
        if disable_dropout and lora is not None and lora.dropout > 0:
            raise ValueError(f"model.lora.dropout {lora.dropout} asks for dropout on the adapter, and model.disable_dropout "
                             "true (GRPO's and OPD's default) for none while training: set lora.dropout 0, or "
                             "disable_dropout false")
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
        self.head_chunk_size = head_chunk_size
        self.sharding = sharding or FSDP2Options()
        self.lora = lora
        self.disable_dropout = disable_dropout
        self._head_is_plain: dict[int, bool] = {}  # per model (id): does its forward apply its head and nothing else?
        self.model = None  # built in configure_model
        self.automatic_optimization = False
        self._last_step_end: float | None = None
        self._val_sums: list[torch.Tensor] = []
        self._compiled = False
        self._base_fingerprint: dict | None = None

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
        if self.disable_dropout and not has_adapter(self.model):  # before the adapter: its own dropout is lora's
            if turned_off := turn_off_dropout(self.model):
                rank_zero_info(f"model: {turned_off} dropout probabilities set to 0 for training (model.disable_dropout)")
        if self.lora is not None and not has_adapter(self.model):
            self.model = add_adapter(self.model, self.lora)
        self.before_sharding()
        if self._fsdp2_strategy() and not is_sharded(self.model):  # torch_compile: refused in `setup`
            apply_fsdp2(self.model, self.device_mesh, self.sharding)
        for frozen in self.frozen_models():  # sharded like the policy they run beside
            if self._fsdp2_strategy() and not is_sharded(frozen):
                apply_fsdp2(frozen, self.device_mesh, self.sharding)
        if self.torch_compile and not self._compiled:
            # The body, which training calls directly (the head runs outside, on trained positions).
            # In place: parameter names, exports and checkpoints unchanged.
            self.model.base_model.compile(dynamic=True)
            self._compiled = True

    def setup(self, stage: str) -> None:
        """Options that cannot work with the run's data or strategy, refused before the model loads.
        A loss on the policy's own samples (GRPO, OPD) refuses dataset rows (a StaticDataModule): they
        carry no sampling logprobs, and the first step failed on that. FSDP2's `sharding` options
        refuse any other strategy, which ignored them."""
        from lit_rl.data.datamodules import StaticDataModule

        data = getattr(self.trainer, "datamodule", None)
        if self.loss_kind not in (None, "cross_entropy") and isinstance(data, StaticDataModule):
            raise ConfigError(
                f"{type(self).__name__} trains on the policy's own samples, with the logprobs they were sampled with, "
                "and data is a StaticDataModule of dataset rows, which have none: sample them with data.class_path "
                "lit_rl.data.rollout_datamodule.RolloutDataModule, or train these rows with lit_rl.modules.SFT")
        # the FSDP2 options, checked before the model loads (`configure_model` applies them)
        fsdp2, default = self._fsdp2_strategy(), vars(FSDP2Options())
        changed = sorted(k for k, v in vars(self.sharding).items() if v != default[k])
        if changed and not fsdp2:
            raise ConfigError(
                f"model.init_args.sharding ({', '.join(f'{k} {getattr(self.sharding, k)!r}' for k in changed)}) applies "
                f"under FSDP2 only (configs/strategies/fsdp2.yaml), and this run's trainer.strategy "
                f"{type(self.trainer.strategy).__name__} would ignore it: train with fsdp2.yaml, or leave sharding out "
                "(mixed precision elsewhere: trainer.precision)")
        if self.torch_compile and fsdp2:
            raise ConfigError("model.init_args.torch_compile is not supported with ModelParallelStrategy (FSDP2) yet; "
                              "set it to false")

    def before_sharding(self) -> None:
        """Called by `configure_model` with the whole model, before FSDP2 shards it (and before a
        checkpoint is restored): where a subclass loads a frozen model beside it (OPD's teacher)
        or copies the initial policy (GRPO's reference). Default: nothing."""

    def frozen_models(self) -> list[torch.nn.Module]:
        """Models that run beside the policy without training (kept outside the module tree: no
        optimizer state, no checkpoint bytes). `configure_model` shards them as it shards the
        policy under FSDP2; `on_fit_start` moves the others to the device. Default: none."""
        return []

    def on_fit_start(self) -> None:
        for frozen in self.frozen_models():
            if not is_sharded(frozen):
                frozen.to(self.device)

    def _fsdp2_strategy(self) -> bool:
        """Whether the trainer's strategy expects the module to shard itself (FSDP2)."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        return self._trainer is not None and isinstance(self._trainer.strategy, ModelParallelStrategy)

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
        if self.lora is not None:  # checked at resume: another alpha would silently rescale the trained adapter
            checkpoint["lit_rl"]["lora"] = adapter_options(self.lora)
        if self._adapter_only_checkpoints():  # the frozen base is loaded again at resume (lit_rl/lora.py)
            for name in frozen_parameter_names(self):
                checkpoint["state_dict"].pop(name, None)
            checkpoint["lit_rl"]["frozen_base"] = self._frozen_base_fingerprint()

    def _adapter_only_checkpoints(self) -> bool:
        """A LoRA run's checkpoints leave the frozen base out, where the whole state dict is in one
        file that Lightning loads after `on_load_checkpoint` (one process, DDP), and under lit-rl's
        FSDP2 strategy, which loads its sharded checkpoints knowing that (lit_rl/model_parallel.py).
        Lightning's sharded strategies (FSDP2, FSDP1) load the model inside the strategy, before
        that hook, expecting every tensor: there it stays whole."""
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            return has_adapter(self.model) and getattr(strategy, "adapter_only_checkpoints", False)
        return has_adapter(self.model)

    def _frozen_base_fingerprint(self) -> dict:
        """`lit_rl.lora.base_fingerprint` of this module, computed once (the base never changes)."""
        if self._base_fingerprint is None:
            self._base_fingerprint = base_fingerprint(self)
        return self._base_fingerprint

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse, before anything is loaded or trained, a checkpoint of another architecture."""
        saved = checkpoint.get("lit_rl")
        if saved is None:
            raise ConfigError("this checkpoint was not written by lit-rl (no 'lit_rl' entry); cannot resume from it")
        ours = self._architecture()
        diff = {k: (saved["architecture"].get(k), ours.get(k)) for k in ours if saved["architecture"].get(k) != ours.get(k)}
        if diff:
            lines = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in diff.items())
            raise ConfigError(
                f"checkpoint is of another model ({saved['model']}) than this run's ({self.model_name}): {lines}"
            )
        state = checkpoint.get("state_dict")  # None: a sharded strategy has restored the module already
        if has_adapter(self.model) and state is not None and not any(is_adapter_key(k) for k in state):
            raise ConfigError("this checkpoint holds no LoRA adapter (it was written without model.lora): resume it "
                              "without model.init_args.lora, or start a LoRA run from its weights (an HFExport "
                              "weights/step_N as model.init_args.model)")
        if saved.get("lora") is not None and self.lora is not None:
            ours = adapter_options(self.lora)
            if diff := [k for k in ours if saved["lora"].get(k) != ours[k]]:
                raise ConfigError(
                    "this LoRA checkpoint's adapter was trained with another model.init_args.lora than this run's: "
                    + ", ".join(f"{k} {saved['lora'].get(k)!r} in the checkpoint, {ours[k]!r} here" for k in diff)
                    + "; resume with the checkpoint's"
                )
        if "frozen_base" in saved:
            self._restore_frozen_base(checkpoint, saved)
        regroup_checkpoint_optimizer_states(self, checkpoint)  # one file: Lightning loads them after this hook

    def _restore_frozen_base(self, checkpoint: dict, saved: dict) -> None:
        """A LoRA checkpoint holds the adapter only: its base must be this run's, which fills in the
        frozen weights it left out, so that Lightning's strict load still checks every other key."""
        if not has_adapter(self.model):
            raise ConfigError("this checkpoint holds a LoRA adapter without its base (it was written with "
                              "model.lora set); resume it with the same model.init_args.lora")
        difference = base_difference(saved["frozen_base"], self._frozen_base_fingerprint())
        if difference:
            raise ConfigError(
                f"this LoRA checkpoint's adapter was trained on another base than this run's model "
                f"({self.model_name}): {difference}. Resume with the model.init_args.model and "
                f"model.init_args.dtype of the run that wrote it ({saved['model']})"
            )
        if "state_dict" not in checkpoint:  # a sharded strategy has restored the module already
            return
        ours = self.state_dict()
        for name in frozen_parameter_names(self):
            checkpoint["state_dict"].setdefault(name, ours[name])

    # ---- the model's outputs at trained positions only ---------------------------------------
    # `model`: the trained model by default; a frozen one beside it (OPD's teacher in process) otherwise.
    def logits(self, micro_batch: dict[str, torch.Tensor], model=None) -> torch.Tensor:
        """Full logits [B, T, V] from the model's own forward: for inspection and models whose
        forward transforms its logits; training uses the head at trained positions instead."""
        # use_cache=False: only then does transformers read packed documents from position_ids.
        out = (model or self.model)(input_ids=micro_batch["input_ids"], position_ids=micro_batch["position_ids"],
                                    use_cache=False)
        return out.logits

    def _hidden_states(self, micro_batch: dict[str, torch.Tensor], model=None) -> torch.Tensor:
        """The decoder body's final (normed) hidden states [B, T, H]."""
        return body(model or self.model)(input_ids=micro_batch["input_ids"], position_ids=micro_batch["position_ids"],
                                         use_cache=False).last_hidden_state

    def _uses_plain_head(self, micro_batch: dict[str, torch.Tensor], model=None) -> bool:
        """Whether the model's logits are exactly its output head applied to the body's hidden
        states, checked once per model on a few tokens (soft-capping or logit scaling would differ).
        The two passes run with dropout off (every module's mode is put back after): a model that
        trains with dropout would draw other masks in each and look transformed."""
        model = model or self.model
        if id(model) not in self._head_is_plain:
            probe = {k: micro_batch[k][:1, :8] for k in ("input_ids", "position_ids")}
            modes = {m: m.training for m in model.modules()}
            model.eval()
            # Eager even with model.torch_compile: compiled, these two no-grad calls of another
            # signature were two more graphs of the body to compile before the first step.
            try:
                with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                    head = model.get_output_embeddings()
                    ours = head(self._hidden_states(probe, model)).float()
                    theirs = self.logits(probe, model).float()
            finally:
                for m, training in modes.items():
                    m.training = training
            plain = ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3)
            self._head_is_plain[id(model)] = plain
            if not plain:
                log.warning(
                    "%s transforms its logits beyond the output head (e.g. soft-capping); lit-rl computes the "
                    "full logits for it (more memory and time with a large vocabulary)", type(model).__name__
                )
        return self._head_is_plain[id(model)]

    def _trained_positions(self, micro_batch: dict[str, torch.Tensor], model=None):
        """Hidden states [N, H] at the positions whose next token is trained, those tokens [N], and
        the model's head (weight, bias)."""
        targets = micro_batch["loss_mask"][:, 1:]  # [B, T-1]
        hidden = self._hidden_states(micro_batch, model)[:, :-1][targets]  # [N, H]
        head = (model or self.model).get_output_embeddings()
        return hidden, micro_batch["input_ids"][:, 1:][targets], head.weight, head.bias

    def target_cross_entropy_sum(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of next-token cross-entropy over the trained tokens (loss_mask True), float32 []."""
        if not self._uses_plain_head(micro_batch):
            return masked_cross_entropy_sum(self.logits(micro_batch), micro_batch["input_ids"], micro_batch["loss_mask"])
        hidden, targets, weight, bias = self._trained_positions(micro_batch)
        return selected_cross_entropy_sum(hidden, weight, targets, bias=bias, chunk_size=self.head_chunk_size)

    @property
    def sampling_process(self) -> SamplingProcess:
        """What the sampler did to the policy's logits (the rollout data module's temperature, top-k
        and top-p; `lit_rl.sampling_process`): the RL losses compare the sampler's logprobs with the
        trainer's of that same distribution. The model's own without a rollout data module."""
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return getattr(data, "sampling_process", RAW)

    def target_logprobs(
        self, micro_batch: dict[str, torch.Tensor], *, with_entropy: bool = False, model=None,
        process: SamplingProcess = RAW,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probability [B, T] of each trained token given the ones before it (0 where
        loss_mask is False, aligned with `input_ids` like inference logprobs), and optionally
        the entropy [B, T] of the distribution it was predicted from (after `process`: the
        temperature, top-k and top-p the token was sampled with). float32, differentiable."""
        mask = micro_batch["loss_mask"].clone()  # [B, T]
        mask[:, 0] = False  # a row's first token is predicted from nothing
        if not self._uses_plain_head(micro_batch, model):
            logits = self.logits(micro_batch, model)  # [B, T, V]
            if not process.is_identity:  # position t predicts token t + 1 (the last predicts nothing here)
                logits = process.apply(logits, F.pad(micro_batch["input_ids"][:, 1:], (0, 1)))  # [B, T, V]
            logprobs = shifted_token_logprobs(logits, micro_batch["input_ids"]) * mask  # [B, T]
            entropy = token_entropy(logits) * mask if with_entropy else None  # [B, T]
            return logprobs, entropy
        hidden, targets, weight, bias = self._trained_positions(micro_batch, model)
        lp, ent = selected_token_logprobs(
            hidden, weight, targets, bias=bias, chunk_size=self.head_chunk_size, with_entropy=with_entropy, process=process
        )  # [N], [N]
        scatter = lambda v: torch.zeros(mask.shape, dtype=v.dtype, device=v.device).masked_scatter(mask, v)  # noqa: E731
        return scatter(lp), None if ent is None else scatter(ent)

    def configure_optimizers(self):
        # only what trains, and no weight decay on biases and norm weights (lit_rl/optim.py says why)
        with config_values_of("model.init_args.optimizer"):
            optimizer = self.optimizer_factory(parameter_groups(self))
        if self.scheduler_factory is None:
            return optimizer
        # The schedule's length defaults to the trainer's optimizer steps (lit_rl/optim.py says why this way).
        with config_values_of("model.init_args.lr_scheduler"):
            scheduler = build_lr_scheduler(self.scheduler_factory, optimizer, trainer_total_steps(self._trainer))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- the algorithm's part ------------------------------------------------------------
    def micro_batch_loss_sum(
        self, micro_batch: dict[str, torch.Tensor]
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The micro-batch's part of the step's loss before normalisation (a sum over its tokens or
        sequences), which `training_step` divides by the `loss_normaliser` of the whole step.
        Optionally also metrics as ``{name: (sum, count)}``, summed over micro-batches and ranks
        and logged as ``train/<name> = sum / count``. Subclasses define it."""
        raise NotImplementedError

    @staticmethod
    def token_means(sums: dict[str, torch.Tensor], names, entropy: torch.Tensor | None,
                    mask: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Metrics logged as means over the step's trained tokens, in `micro_batch_loss_sum`'s
        ``{name: (sum, count)}`` form: each of `names` from a loss's metric sums (which count
        their tokens in ``sums["tokens"]``), plus the mean `entropy` [B, T] at `mask` if given."""
        tokens = sums["tokens"]
        metrics = {name: (sums[name], tokens) for name in names}
        if entropy is not None:
            metrics["entropy"] = (entropy.detach()[mask].sum(), tokens)
        return metrics

    def loss_normaliser(self, micro_batch: dict[str, torch.Tensor]) -> float:
        """The micro-batch's part of what the step's loss sum is divided by; summed over the step's
        micro-batches and ranks before any backward. Default: its trained tokens (SFT)."""
        return trained_tokens(micro_batch)

    # ---- validation: the same loss over a held-out split -------------------------------------
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # as many micro-batches on every rank (empty ones where a rank has fewer rows, or none in the
        # last step): under FSDP each forward is a collective
        micro_batches = self._step_micro_batches(batch)
        outs = (self._split_loss_output(self.micro_batch_loss_sum(mb))[0] for mb in micro_batches)
        loss_sum = sum((out.detach() for out in outs), torch.zeros((), device=self.device))
        targets = sum(self.loss_normaliser(mb) for mb in micro_batches)
        self._val_sums.append(torch.stack([loss_sum.float().cpu(), torch.tensor(float(targets))]))

    def on_validation_epoch_end(self) -> None:
        sums = torch.stack(self._val_sums).sum(0) if self._val_sums else torch.zeros(2)
        self._val_sums.clear()
        sums = self._sum_over_ranks(sums.to(self.device))
        self.log("val/loss", sums[0] / sums[1].clamp(min=1.0), batch_size=1)
