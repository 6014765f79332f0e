"""Sample and SampleGroup: the one training-sequence format shared by every data source.

A Sample is a whole sequence (prompt + completion) with a per-token `loss_mask`. RL
data rides along as per-token fields of the same length (`logprobs`, `advantages`,
`teacher_logprobs`; `teacher_topk_ids` and `teacher_topk_logprobs` with k values per token), checked at construction so that a length bug surfaces where the
sample is made, not as a shape error deep inside a packed loss. The RL fields stay
None for SFT rows. See the Sample and RL samples contracts in DESIGN.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

#: who made a sample's tokens: a dataset row, the policy being trained (its own samples), a frozen
#: teacher (its completions, SFT data). The one vocabulary of sources, in samples, configs and metrics.
SOURCES = ("static", "policy", "teacher")
SAMPLERS = ("policy", "teacher")  # the sources rollouts come from

PER_TOKEN_FIELDS = ("logprobs", "advantages", "teacher_logprobs")  # float, len(input_ids) each; packing carries them
#: k values per token (len(input_ids) rows of k): a teacher server's top-k next tokens and their logprobs (OPD)
PER_TOKEN_TOPK_FIELDS = ("teacher_topk_ids", "teacher_topk_logprobs")


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[bool]  # loss_mask[i]: token i is a trained target (predicted from token i-1)
    logprobs: list[float] | None = None  # sampling logprobs the server returned for completion tokens, 0 elsewhere
    advantages: list[float] | None = None  # per token; GRPO repeats the sequence's advantage, OPD sets each
    teacher_logprobs: list[float] | None = None  # the teacher's logprob of each token (OPD)
    policy_version: int | None = None  # weights version that started the rollout (stamped by the buffer)
    reward: float | None = None
    source: str = "static"  # who made its tokens, one of SOURCES
    truncated: bool = False  # cut to max_length by the data source
    finish_reason: str | None = None  # the server's finish reason for a rollout completion; "length": hit max_tokens
    metadata: dict = field(default_factory=dict)  # free-form, kept in traces
    # A teacher server's k most likely next tokens at each position and their logprobs (dense OPD
    # from a server); [0] * k where the token is not trained.
    teacher_topk_ids: list[list[int]] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        problems = [f"loss_mask has {len(self.loss_mask)}"] if len(self.loss_mask) != n else []
        for name in PER_TOKEN_FIELDS:
            values = getattr(self, name)
            if values is not None and len(values) != n:
                problems.append(f"{name} has {len(values)}")
        widths = {len(row) for name in PER_TOKEN_TOPK_FIELDS for row in (getattr(self, name) or ())}
        for name in PER_TOKEN_TOPK_FIELDS:
            values = getattr(self, name)
            if values is not None and len(values) != n:
                problems.append(f"{name} has {len(values)} rows")
        if len(widths) > 1:
            problems.append(f"the top-k fields have rows of {sorted(widths)} values, not one k")
        if problems:
            raise ValueError(f"Sample: input_ids has {n} tokens but {', '.join(problems)}; per-token fields need one value per token")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask)

    @property
    def has_sampling_logprobs(self) -> bool:
        """False for static rows: no server sampled them, so there is no behaviour policy to correct for."""
        return self.logprobs is not None

    def with_advantage(self, advantage: float) -> Sample:
        """A copy whose `advantages` hold one sequence-level value (GRPO) on the loss_mask tokens, 0 elsewhere."""
        advantages = [float(advantage) if m else 0.0 for m in self.loss_mask]
        return dataclasses.replace(self, advantages=advantages, metadata=dict(self.metadata))


@dataclass
class SampleGroup:
    """The samples of one task (group_size of them); accepted or rejected as a whole."""

    samples: list[Sample] = field(default_factory=list)
    task_id: str | None = None
