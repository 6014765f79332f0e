"""OPD: on-policy distillation, the student's own samples scored token by token by a teacher.

The student samples completions of the environment's prompts (the rollout buffer, as in
GRPO); a frozen teacher served by its own vLLM server scores exactly the sampled tokens with
one prefill per completion (the run's `InferenceRuntime` serves it, from `inference.teacher_model`
or `inference.teacher_base_url`; the rollout buffer fills each sample's `teacher_logprobs`). The per-token advantage is the teacher's logprob
minus the sampler's, the negative of the sampled token's reverse-KL estimate, with no
discount over later tokens (Agarwal et al. 2024; Thinking Machines' "On-Policy
Distillation"): the policy gradient of that advantage lowers KL(student || teacher) on the
student's own distribution. The loss is `lit_rl.losses.opd_loss`, normalised by the step's
completion tokens over all micro-batches and ranks, with the same behaviour-policy
correction as GRPO for samples drawn by weights up to `max_staleness` steps old.

Why on-policy: supervised distillation (SFT on the teacher's samples) trains on states the
student would not reach; here every trained token is one the student produced, and the
teacher grades each of them, a denser signal than one reward per completion.

An environment's reward can mix in: `reward_weight` times the group-relative reward
advantage is added to every token's distillation advantage.
"""

from __future__ import annotations

import torch

from lit_rl.errors import ConfigError
from lit_rl.losses import OPD_METRICS, check_behaviour_options, opd_loss_sums
from lit_rl.modules.base import CausalLMModule


class OPD(CausalLMModule):
    loss_kind = "distillation"

    def __init__(
        self,
        *args,
        is_correction: str = "token_truncate",
        is_cap: float = 2.0,
        reward_weight: float = 0.0,
        log_entropy: bool = True,
        **kwargs,
    ):
        """
        Args:
            is_correction: behaviour-policy weight w = exp(trainer - sampler logprob) per token:
                ``token_truncate`` min(w, is_cap), ``token_mask`` w if w <= is_cap else 0, ``none`` 1.
            is_cap: the cap of w.
            reward_weight: weight of the environment's group-relative reward advantage added to
                each token's distillation advantage; 0 (default): distillation only.
            log_entropy: log the mean entropy of the distributions the completion tokens were
                sampled from (an extra pass over each head chunk, no backward).
            *args, **kwargs: the `CausalLMModule` arguments (model, optimizer, ...).
        """
        super().__init__(*args, **kwargs)
        problems = check_behaviour_options(is_correction, is_cap)
        if reward_weight < 0:
            problems.append(f"reward_weight must be >= 0, got {reward_weight}")
        if problems:
            raise ValueError("OPD: " + "; ".join(problems))
        self.is_correction, self.is_cap, self.reward_weight, self.log_entropy = is_correction, is_cap, reward_weight, log_entropy

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None)
        if stage == "fit" and not getattr(data, "has_teacher", False):  # its samples carry the teacher's scores
            raise ConfigError(
                "OPD needs a teacher to score the student's samples: set inference.teacher_model (lit-rl starts a "
                "vLLM server for it) or inference.teacher_base_url (an existing server), with a RolloutDataModule"
            )

    def micro_batch_loss_sum(self, micro_batch: dict[str, torch.Tensor]):
        if "teacher_logprobs" not in micro_batch or "logprobs" not in micro_batch:
            raise ValueError("OPD trains on rollouts with sampling and teacher logprobs; use a RolloutDataModule "
                             "and a teacher (inference.teacher_model or inference.teacher_base_url)")
        logprobs, entropy = self.target_logprobs(micro_batch, with_entropy=self.log_entropy)  # [B, T], [B, T]
        mask = micro_batch["loss_mask"]  # [B, T]
        loss_sum, sums = opd_loss_sums(
            logprobs, logprobs.detach(), micro_batch["logprobs"], micro_batch["teacher_logprobs"], mask,
            is_correction=self.is_correction, is_cap=self.is_cap,
            advantages=micro_batch.get("advantages"), reward_weight=self.reward_weight,
        )
        return loss_sum, self.token_means(sums, OPD_METRICS, entropy, mask)
