"""GRPO: the clipped policy gradient on rollouts, corrected for the sampler's policy.

Each step trains one batch of rollouts (`lit_rl.data.RolloutDataModule`): for every
completion token, the trainer's log-probability under the current weights (the output
head at those positions only, `CausalLMModule.target_logprobs`), the sampler's
log-probability the inference server returned with it, and the sequence's advantage
(reward minus its group's mean, by default over the group's std). The loss is
`lit_rl.losses.policy_loss`; read its docstring for the formula and each knob.

Two policies stand between a sample and the gradient. The "old" policy is the trainer's
weights at the batch's first update: with `updates_per_batch=U` (TRL's `num_iterations`,
the paper's mu) each batch feeds U optimizer steps, and the clipped ratio exp(logp - old)
keeps the later updates in a trust region (`clip_low`, `clip_high`; `train/clip_fraction`
says how often it binds). With U = 1 (the default) the ratio is 1 and clipping never acts.
The sampler is the inference server's copy of weights up to `max_staleness` steps older,
with its own numerics: that off-policy part is carried by the behaviour-policy weight
exp(old - inference), truncated at `is_cap` (prime-rl, verl). The default aggregation is
DAPO's token mean over the whole step (`loss_type="dapo"`); the KL penalty to a frozen
reference is off by default (`kl_coef=0`: no reference is loaded and nothing is computed
for it).

The old logprobs cost no extra forward: the first update's own forward, detached, is the
old policy's (`lit_rl.data.held_batch`). The server is synced after every optimizer step,
not every batch: the next batches' rollouts then come from the newest weights and
`max_staleness` means what it says in steps, at one reload per step as with U = 1.

The step's normaliser (tokens for dapo, sequences for grpo/gspo) is counted over all
micro-batches and ranks before the backward, so the update equals `policy_loss` over the
step's samples as one batch, however they are split and packed.
"""

from __future__ import annotations

import copy
import math

import torch

from lit_rl.data.held_batch import old_logprobs
from lit_rl.errors import ConfigError
from lit_rl.losses import POLICY_METRICS, check_policy_loss_options, policy_loss_normaliser, policy_loss_sums
from lit_rl.lora import adapter_disabled, has_adapter
from lit_rl.modules.base import CausalLMModule
from lit_rl.modules.model_loading import load_causal_lm


class GRPO(CausalLMModule):
    loss_kind = "policy_gradient"

    def __init__(
        self,
        *args,
        loss_type: str = "dapo",
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        is_correction: str = "token_truncate",
        is_cap: float = 2.0,
        max_completion_length: int | None = None,
        kl_coef: float = 0.0,
        reference_model: str | None = None,
        log_entropy: bool = True,
        updates_per_batch: int = 1,
        disable_dropout: bool = True,
        **kwargs,
    ):
        """
        Args:
            loss_type: aggregation over tokens: ``dapo`` (sum over the step's completion tokens
                / their number), ``grpo`` (mean over sequences of each one's token mean),
                ``dr_grpo`` (sum / (sequences x max_completion_length)), ``gspo`` (one clipped
                ratio per sequence, aggregated like grpo).
            clip_low: the ratio is clipped below at 1 - clip_low.
            clip_high: ... and above at 1 + clip_high (DAPO's asymmetric "clip higher").
            is_correction: behaviour-policy weight w = exp(trainer - sampler logprob) per token:
                ``token_truncate`` min(w, is_cap), ``token_mask`` w if w <= is_cap else 0, ``none`` 1.
            is_cap: the cap of w.
            max_completion_length: the constant of ``dr_grpo`` (at least the rollouts' max_tokens); refused
                with another loss_type (TRL's generation limit of that name is ``data.max_tokens`` here).
            kl_coef: weight of a per-token KL penalty to a frozen reference model (k3
                estimator, exp(ref - logp) - (ref - logp) - 1); 0 turns it off at no cost.
            reference_model: the reference's name or path; None: the policy's weights at the
                start of training (before any checkpoint is restored). It must share the policy's vocabulary;
                refused with kl_coef 0, which loads none.
            log_entropy: log the mean entropy of the distributions the completion tokens were
                sampled from (an extra pass over each head chunk, no backward).
            updates_per_batch: optimizer steps on each rollout batch (each on the whole batch,
                TRL's ``num_iterations``); the clipped ratio is to the weights of the batch's
                first update. ``trainer.max_steps`` still counts optimizer steps.
            disable_dropout: train with the model's dropout off (the `CausalLMModule` argument; on
                here: the loss compares the trainer's log-probabilities with the sampler's, which has none).
            *args, **kwargs: the `CausalLMModule` arguments (model, optimizer, ...).
        """
        super().__init__(*args, disable_dropout=disable_dropout, **kwargs)
        problems = check_policy_loss_options(loss_type, is_correction, clip_low, clip_high, is_cap, max_completion_length)
        if not 0 <= kl_coef < math.inf:  # NaN (a YAML .nan) would turn the penalty off, inf make every loss NaN
            problems.append(f"kl_coef must be a finite number >= 0, got {kl_coef}")
        elif reference_model and not kl_coef:  # the reference serves the KL penalty only: nothing would load it
            problems.append(f"reference_model {reference_model!r} is the reference of the KL penalty, which kl_coef 0 "
                            "turns off (the reference is never loaded): set kl_coef > 0, or reference_model null")
        if max_completion_length is not None and loss_type != "dr_grpo":  # TRL's name for the generation limit
            problems.append(f"max_completion_length ({max_completion_length}) is dr_grpo's constant only, unused by "
                            f"loss_type {loss_type!r}; completions are limited by data.init_args.max_tokens: "
                            "set that, and max_completion_length null")
        if not isinstance(updates_per_batch, int) or isinstance(updates_per_batch, bool) or updates_per_batch < 1:
            problems.append(f"updates_per_batch must be an int >= 1, got {updates_per_batch!r}")
        if problems:
            raise ValueError("GRPO: " + "; ".join(problems))
        self.loss_type, self.clip_low, self.clip_high = loss_type, clip_low, clip_high
        self.is_correction, self.is_cap, self.max_completion_length = is_correction, is_cap, max_completion_length
        self.kl_coef, self.reference_model, self.log_entropy = kl_coef, reference_model, log_entropy
        self.updates_per_batch = updates_per_batch
        self._reference = None  # frozen; deliberately not a submodule: no optimizer state, no checkpoint bytes

    def before_sharding(self) -> None:
        """The frozen reference, once: `reference_model`, or a copy of the policy's initial weights,
        taken here because a copy of an FSDP2-sharded model is not a model of its own."""
        if self.kl_coef <= 0 or self._reference is not None or (has_adapter(self.model) and not self.reference_model):
            return  # with a LoRA adapter the reference is the policy with its adapter disabled: no copy
        if self.reference_model:
            ref = load_causal_lm(self.reference_model, dtype=self.dtype_name, trust_remote_code=self.trust_remote_code,
                                 attn_implementation=self.attn_implementation)
            # its logprobs are read at the policy's token ids: another vocabulary fails at the first step
            # (an id past its head) or, larger, gives a KL between unrelated tokens; refused before any server
            rows, ours = ref.get_output_embeddings().weight.shape[0], self.model.get_output_embeddings().weight.shape[0]
            if rows != ours:
                raise ConfigError(f"GRPO: model.init_args.reference_model {self.reference_model} has an output head of "
                                  f"{rows} tokens, the policy {ours}: the KL reference must share the policy's vocabulary")
        else:
            ref = copy.deepcopy(self.model)  # before Lightning restores a checkpoint: the initial policy
        # object.__setattr__: nn.Module would register it as a submodule (trained, checkpointed, synced)
        object.__setattr__(self, "_reference", ref.eval().requires_grad_(False))

    def frozen_models(self) -> list[torch.nn.Module]:
        return [] if self._reference is None else [self._reference]

    def _reference_logprobs(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference model's log-probability [B, T] of each trained token (0 elsewhere), of the
        distribution the policy sampled from (the same temperature, top-k and top-p)."""
        with torch.no_grad():
            if self._reference is None:  # a LoRA policy's own base
                with adapter_disabled(self.model):
                    return self.target_logprobs(micro_batch, process=self.sampling_process)[0]
            return self.target_logprobs(micro_batch, model=self._reference, process=self.sampling_process)[0]

    def loss_normaliser(self, micro_batch: dict[str, torch.Tensor]) -> float:
        return policy_loss_normaliser(micro_batch["loss_mask"], micro_batch["sequence_ids"], loss_type=self.loss_type,
                                      max_completion_length=self.max_completion_length)

    def micro_batch_loss_sum(self, micro_batch: dict[str, torch.Tensor]):
        if "logprobs" not in micro_batch or "advantages" not in micro_batch:
            raise ValueError("GRPO trains on rollouts with sampling logprobs and advantages; use a RolloutDataModule")
        logprobs, entropy = self.target_logprobs(micro_batch, with_entropy=self.log_entropy,
                                                 process=self.sampling_process)  # [B, T], [B, T]
        mask = micro_batch["loss_mask"]  # [B, T]
        kl = None
        if self.kl_coef > 0:
            log_ratio = self._reference_logprobs(micro_batch) - logprobs  # [B, T]
            kl = torch.exp(log_ratio) - log_ratio - 1.0  # [B, T]
        update = self.trainer.global_step % self.updates_per_batch if self.updates_per_batch > 1 else 0
        old = old_logprobs(micro_batch, logprobs, update)
        loss_sum, sums = policy_loss_sums(
            logprobs, old, micro_batch["logprobs"], micro_batch["advantages"], mask,
            micro_batch["sequence_ids"], loss_type=self.loss_type, clip_low=self.clip_low, clip_high=self.clip_high,
            is_correction=self.is_correction, is_cap=self.is_cap,
            extra_token_loss=None if kl is None else self.kl_coef * kl,
        )
        metrics = self.token_means(sums, POLICY_METRICS, entropy, mask)
        if kl is not None:
            metrics["kl_to_reference"] = (kl.detach()[mask].sum(), sums["tokens"])
        return loss_sum, metrics
