"""OPD: on-policy distillation, the student's own samples scored token by token by a teacher.

The student samples completions of the environment's prompts (the rollout buffer, as in
GRPO) and a frozen teacher grades every sampled position. Where the teacher runs and what it
returns decide which `divergence` can be trained:

- a teacher server (`inference.teacher_model` or `inference.teacher_base_url`, served by the run's
  `InferenceRuntime`): one prefill per completion gives the logprob of each sampled token, which
  the rollout buffer puts on the sample as `teacher_logprobs`, and (for a dense divergence) the
  teacher's `teacher_top_k` most likely tokens at each position with their logprobs
  (`teacher_topk_ids`, `teacher_topk_logprobs`). `sampled_reverse_kl` uses the first: the
  per-token advantage is the teacher's logprob minus the sampler's, the negative of the sampled
  token's reverse-KL estimate, with no discount over later tokens (Agarwal et al. 2024; Thinking
  Machines' "On-Policy Distillation"), trained as a policy gradient (`lit_rl.losses.opd_loss`)
  with GRPO's behaviour-policy correction, each token's advantage centred on the step's mean
  (`advantage_baseline`: without it nearly every sampled token is pushed down, and the first
  steps lose held-out reward). The dense divergences use the second: both
  distributions coarsened to the teacher's top k and one bin for the rest of the vocabulary
  (`lit_rl.losses.topk_bins`), the student's side from the trainer's own logits at trained
  positions (`lit_rl.chunked_head.selected_topk_divergence_sum`).
- a teacher in this process (`model.teacher_model`): a frozen copy of the teacher runs on the
  same micro-batches, and the divergence is exact over the whole vocabulary at every trained
  position (`lit_rl.losses.token_divergence`: `forward_kl`, `reverse_kl`, or `jsd` with `beta`,
  as in TRL's DistillationTrainer), both heads applied in chunks at trained positions only
  (`lit_rl.chunked_head.selected_divergence_sum`). `sampled_reverse_kl` works here too.

Why the dense divergences learn faster: one sampled token per position tells the student
"not this" but never "what"; the full distribution says both, and its gradient is exact rather
than a noisy estimate whose advantages are mostly negative. The dense loss has no behaviour
weight: it is a divergence at the states the student visited, not an estimate over its tokens.

Every loss is normalised by the step's trained tokens over all micro-batches and ranks.
An environment's reward can mix into `sampled_reverse_kl`: `reward_weight` times the
group-relative reward advantage is added to every token's distillation advantage.
"""

from __future__ import annotations

import math

import torch

from lit_rl.chunked_head import selected_divergence_sum, selected_topk_divergence_sum
from lit_rl.errors import ConfigError
from lit_rl.losses import (DENSE_DIVERGENCES, OPD_METRICS, check_advantage_options, check_behaviour_options, check_divergence_options,
                           distillation_advantage, divergence_beta, opd_loss_sums, token_divergence, topk_bins)
from lit_rl.modules.base import CausalLMModule
from lit_rl.modules.model_loading import load_causal_lm


def ignored_option_problems(divergence: str, teacher_model: str | None, **given) -> list[str]:
    """The options `divergence` (with or without an in-process teacher) does not use, set to another
    value than their default: a user tuning one of them would see nothing change. `beta` is `jsd`'s;
    the behaviour weight and the advantage's baseline and clip are the sampled-token estimator's;
    `teacher_top_k` is what a teacher server returns for a dense divergence."""
    import inspect

    defaults = {name: p.default for name, p in inspect.signature(OPD.__init__).parameters.items()}
    unused = {"teacher_top_k": "it is how many tokens a teacher server returns for a dense divergence"}
    if divergence in DENSE_DIVERGENCES:
        unused = {} if teacher_model is None else {"teacher_top_k": "model.teacher_model gives the whole distribution"}
        unused |= {name: f"the dense divergence {divergence!r} has no sampled-token advantage"
                   for name in ("is_correction", "is_cap", "advantage_baseline", "advantage_clip", "log_entropy")}
    if divergence != "jsd" and given.get("beta") != DENSE_DIVERGENCES.get(divergence):  # reverse_kl is beta 1, forward_kl 0
        unused["beta"] = "it is jsd's mixture weight"
    return [f"{name} {given[name]!r} does nothing with divergence {divergence!r}: {why}; leave it out"
            for name, why in unused.items() if name in given and given[name] != defaults[name]]


IN_PROCESS_TEACHER_LOGPROBS = "in_process_teacher_logprobs"  # where a micro-batch keeps them within a step


class OPD(CausalLMModule):
    loss_kind = "distillation"

    def __init__(
        self,
        *args,
        divergence: str = "sampled_reverse_kl",
        beta: float = 0.5,
        teacher_model: str | None = None,
        teacher_top_k: int = 20,
        is_correction: str = "token_truncate",
        is_cap: float = 2.0,
        reward_weight: float = 0.0,
        advantage_baseline: str = "step_mean",
        advantage_clip: float | None = 1.0,
        log_entropy: bool = True,
        disable_dropout: bool = True,
        **kwargs,
    ):
        """
        Args:
            divergence: what the loss measures between the student and the teacher at each trained
                position: ``sampled_reverse_kl`` (the sampled token's reverse-KL estimate, as a policy
                gradient), or over the whole vocabulary (``teacher_model``) or the teacher server's
                top ``teacher_top_k`` tokens and a tail bin: ``reverse_kl`` KL(student || teacher), ``forward_kl`` KL(teacher || student), ``jsd``
                the generalised Jensen-Shannon divergence with ``beta`` (docs/distillation.md).
            beta: the ``jsd`` mixture weight of the teacher, in [0, 1]: 0 is forward KL, 1 reverse KL.
            teacher_top_k: with a teacher server and a dense divergence: how many of the teacher's most
                likely tokens it returns per position (vLLM's ``prompt_logprobs``; a vLLM server allows
                up to its ``--max-logprobs``, 20 by default). The divergence is over those k tokens and
                one bin for the rest; the larger k, the closer to the whole-vocabulary divergence.
            teacher_model: a teacher loaded in this process, frozen (hub name, directory or built-in
                model; the same dtype and attention as ``model``), instead of a teacher server. It
                must share the student's tokenizer.
            is_correction: ``sampled_reverse_kl``'s behaviour-policy weight w = exp(trainer - sampler
                logprob) per token: ``token_truncate`` min(w, is_cap), ``token_mask`` w if w <= is_cap
                else 0, ``none`` 1.
            is_cap: the cap of w.
            reward_weight: weight of the environment's group-relative reward advantage added to
                each token's distillation advantage (``sampled_reverse_kl`` only); 0: distillation only.
            advantage_baseline: ``sampled_reverse_kl``'s baseline: ``step_mean`` subtracts the mean
                distillation advantage of the step's trained tokens (all micro-batches and ranks) from
                each, so that sampled tokens the teacher likes better than average are pushed up and
                the rest down (unbiased: E[grad log p] = 0); ``none`` keeps the raw advantage, which
                is -KL on average and pushes nearly every sampled token down (docs/distillation.md).
            advantage_clip: ``sampled_reverse_kl``: each token's distillation advantage clipped to
                [-advantage_clip, advantage_clip] before the baseline (1 nat: measured without a dip
                at both batch shapes, docs/distillation.md); None: not clipped. The dense
                divergences have no advantage and ignore it.
            log_entropy: log the mean entropy of the distributions the completion tokens were
                sampled from (an extra pass over each head chunk, no backward).
            disable_dropout: train with the model's dropout off (the `CausalLMModule` argument; on
                here: the loss compares the trainer's log-probabilities with the sampler's, which has none).
            *args, **kwargs: the `CausalLMModule` arguments (model, optimizer, ...).
        """
        super().__init__(*args, disable_dropout=disable_dropout, **kwargs)
        problems = (check_behaviour_options(is_correction, is_cap) + check_divergence_options(divergence, beta)
                    + check_advantage_options(advantage_baseline, advantage_clip))
        if not isinstance(teacher_top_k, int) or isinstance(teacher_top_k, bool) or teacher_top_k < 1:
            problems.append(f"teacher_top_k must be an int >= 1, got {teacher_top_k!r}")
        if not 0 <= reward_weight < math.inf:  # NaN (a YAML .nan) or inf would make every advantage NaN or inf
            problems.append(f"reward_weight must be a finite number >= 0, got {reward_weight}")
        if reward_weight and divergence != "sampled_reverse_kl":
            problems.append(f"reward_weight mixes a reward into the sampled-token advantage; divergence {divergence!r} "
                            "has none (use divergence 'sampled_reverse_kl' or reward_weight 0)")
        problems += ignored_option_problems(divergence, teacher_model, beta=beta, teacher_top_k=teacher_top_k,
                                            is_correction=is_correction, is_cap=is_cap,
                                            advantage_baseline=advantage_baseline, advantage_clip=advantage_clip,
                                            log_entropy=log_entropy)
        if problems:
            raise ValueError("OPD: " + "; ".join(problems))
        self.divergence, self.beta, self.teacher_model, self.teacher_top_k = divergence, beta, teacher_model, teacher_top_k
        self.is_correction, self.is_cap, self.reward_weight, self.log_entropy = is_correction, is_cap, reward_weight, log_entropy
        self.advantage_baseline, self.advantage_clip = advantage_baseline, advantage_clip
        # The in-process teacher stays outside the module tree: not trained, not in checkpoints or exports.
        object.__setattr__(self, "teacher", None)

    @property
    def dense(self) -> bool:
        return self.divergence != "sampled_reverse_kl"

    @property
    def served_teacher_top_k(self) -> int:
        """How many top tokens per position a teacher server must return with its scores (the
        rollout data module asks): `teacher_top_k` for a dense divergence without a teacher here."""
        return self.teacher_top_k if self.dense and self.teacher_model is None else 0

    # ---- the teacher ---------------------------------------------------------------------------
    def before_sharding(self) -> None:
        if self.teacher_model is None or self.teacher is not None:
            return
        teacher = load_causal_lm(self.teacher_model, dtype=self.dtype_name, trust_remote_code=self.trust_remote_code,
                                 attn_implementation=self.attn_implementation)
        teacher.eval().requires_grad_(False)
        rows, ours = teacher.get_output_embeddings().weight.shape[0], self.model.get_output_embeddings().weight.shape[0]
        if rows != ours:
            raise ConfigError(f"OPD: model.teacher_model {self.teacher_model} has an output head of {rows} tokens, "
                              f"the student {ours}: a teacher must share the student's vocabulary")
        object.__setattr__(self, "teacher", teacher)

    def frozen_models(self) -> list[torch.nn.Module]:
        return [] if self.teacher is None else [self.teacher]

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        data = getattr(self.trainer, "datamodule", None)
        served = getattr(data, "has_teacher", False)  # its samples carry a teacher server's scores
        if self.teacher_model is not None and served:
            raise ConfigError("OPD: two teachers: model.teacher_model loads one in this process and inference.teacher_model "
                              "or inference.teacher_base_url serves one; set one of them")
        if self.teacher_model is None and not served:
            raise ConfigError(
                "OPD needs a teacher to score the student's samples: set model.teacher_model (loaded in this process), "
                "inference.teacher_model (lit-rl starts a vLLM server for it) or inference.teacher_base_url (an existing "
                "server), with a RolloutDataModule"
            )
        if self.teacher_model is not None:
            self._check_teacher_tokenizer()

    def _check_teacher_tokenizer(self) -> None:
        from lit_rl.model_names import load_tokenizer
        from lit_rl.rollouts.teacher import tokenizer_mismatch

        problem = tokenizer_mismatch(load_tokenizer(self.tokenizer_name, trust_remote_code=self.trust_remote_code),
                                     load_tokenizer(self.teacher_model, trust_remote_code=self.trust_remote_code))
        if problem:
            raise ConfigError(f"OPD: model.teacher_model {self.teacher_model} {problem}")

    # ---- the sampled-token estimator's baseline ---------------------------------------------------
    @property
    def step_statistic_names(self) -> tuple[str, ...]:
        centred = not self.dense and self.advantage_baseline == "step_mean"
        return ("advantage_sum", "advantage_tokens") if centred else ()

    def step_statistics(self, micro_batch: dict) -> dict[str, torch.Tensor]:
        """The step-mean baseline's sums: the distillation advantage over this micro-batch's trained
        tokens. An in-process teacher's logprobs are computed here once and kept on the micro-batch."""
        if not self.step_statistic_names:
            return {}
        micro_batch.update(self._with_teacher_logprobs(micro_batch))
        mask = micro_batch["loss_mask"].bool()
        advantage = distillation_advantage(micro_batch["teacher_logprobs"][mask], micro_batch["logprobs"][mask],
                                           self.advantage_clip)  # [N]
        return {"advantage_sum": advantage.sum(), "advantage_tokens": mask.sum().float()}

    def _with_teacher_logprobs(self, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The micro-batch with the teacher's logprob of each trained token: a teacher server's (on the
        samples), or the in-process teacher's, computed once per micro-batch and step (kept under
        ``in_process_teacher_logprobs``). The in-process teacher runs on every micro-batch, stand-ins
        too: under FSDP each of its forwards is a collective that every rank must join."""
        if self.teacher is None:
            if "teacher_logprobs" not in micro_batch:
                raise ValueError("OPD: the samples carry no teacher_logprobs: set inference.teacher_model or "
                                 "inference.teacher_base_url (a teacher server), or model.teacher_model")
            return micro_batch
        scored = micro_batch.get(IN_PROCESS_TEACHER_LOGPROBS)
        if scored is None:
            with torch.no_grad():
                scored, _ = self.target_logprobs(micro_batch, model=self.teacher)  # [B, T]
        return {**micro_batch, IN_PROCESS_TEACHER_LOGPROBS: scored, "teacher_logprobs": scored}

    def _baseline(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor | float:
        """The ``step_mean`` baseline: from the step's totals in a training step, else (validation)
        over this micro-batch alone."""
        if not self.step_statistic_names:
            return 0.0
        totals = self.step_totals or self.step_statistics(dict(micro_batch))
        return totals["advantage_sum"] / max(float(totals["advantage_tokens"]), 1.0)

    # ---- the loss ---------------------------------------------------------------------------------
    def micro_batch_loss_sum(self, micro_batch: dict[str, torch.Tensor]):
        if "logprobs" not in micro_batch:
            raise ValueError("OPD trains on the student's own samples with their sampling logprobs; use a RolloutDataModule")
        if self.dense:
            return self._dense_loss_sum(micro_batch)
        micro_batch = self._with_teacher_logprobs(micro_batch)
        logprobs, entropy = self.target_logprobs(micro_batch, with_entropy=self.log_entropy,
                                                 process=self.sampling_process)  # [B, T], [B, T]
        mask = micro_batch["loss_mask"]  # [B, T]
        loss_sum, sums = opd_loss_sums(
            logprobs, logprobs.detach(), micro_batch["logprobs"], micro_batch["teacher_logprobs"], mask,
            is_correction=self.is_correction, is_cap=self.is_cap,
            advantages=micro_batch.get("advantages"), reward_weight=self.reward_weight,
            advantage_clip=self.advantage_clip, baseline=self._baseline(micro_batch),
        )
        return loss_sum, self.token_means(sums, OPD_METRICS, entropy, mask)

    def _dense_loss_sum(self, micro_batch: dict[str, torch.Tensor]):
        beta = divergence_beta(self.divergence, self.beta)
        targets = micro_batch["loss_mask"][:, 1:]  # [B, T-1]
        if self.teacher is None:
            loss_sum = self._served_topk_loss_sum(micro_batch, targets, beta)
        elif self._uses_plain_head(micro_batch) and self._uses_plain_head(micro_batch, self.teacher):
            hidden, _, weight, bias = self._trained_positions(micro_batch)
            with torch.no_grad():
                teacher_hidden, _, teacher_weight, teacher_bias = self._trained_positions(micro_batch, self.teacher)
            loss_sum = selected_divergence_sum(hidden, weight, teacher_hidden, teacher_weight, beta=beta, student_bias=bias,
                                               teacher_bias=teacher_bias, chunk_size=self.head_chunk_size)
        else:  # a model whose forward transforms its logits: the full logits of both
            student = torch.log_softmax(self.logits(micro_batch)[:, :-1][targets].float(), dim=-1)  # [N, V]
            with torch.no_grad():
                teacher = torch.log_softmax(self.logits(micro_batch, self.teacher)[:, :-1][targets].float(), dim=-1)
            loss_sum = token_divergence(student, teacher, beta).sum()
        tokens = targets.sum().to(loss_sum)
        return loss_sum, {"divergence": (loss_sum.detach(), tokens)}

    def _served_topk_loss_sum(self, micro_batch: dict[str, torch.Tensor], targets: torch.Tensor, beta: float):
        """The divergence over a teacher server's top-k tokens and a tail bin, at trained positions."""
        if "teacher_topk_ids" in micro_batch:  # row i: the distribution of token i given the ones before it
            ids = micro_batch["teacher_topk_ids"][:, 1:][targets]  # [N, k]
            teacher = micro_batch["teacher_topk_logprobs"][:, 1:][targets]  # [N, k]
        elif not targets.any():  # a stand-in micro-batch: nothing to score
            ids = targets.new_zeros((0, 1), dtype=torch.long)
            teacher = torch.zeros((0, 1), device=targets.device)
        else:
            raise ValueError("OPD: the samples carry no teacher_topk_ids: a dense divergence from a teacher server needs "
                             "its top-k tokens (RolloutDataModule with inference.teacher_model or teacher_base_url); "
                             "samples a checkpoint kept from a run with divergence sampled_reverse_kl have none: resume "
                             "with the divergence the run was started with")
        if self._uses_plain_head(micro_batch):
            hidden, _, weight, bias = self._trained_positions(micro_batch)
            return selected_topk_divergence_sum(hidden, weight, ids, teacher, beta=beta, student_bias=bias,
                                                chunk_size=self.head_chunk_size)
        student = torch.log_softmax(self.logits(micro_batch)[:, :-1][targets].float(), dim=-1)  # [N, V]
        return token_divergence(*topk_bins(student, ids, teacher), beta).sum()
