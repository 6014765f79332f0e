"""Sample and SampleGroup: the one training-sequence format shared by every data source.

A Sample is a whole sequence (prompt + completion) with a per-token `loss_mask`. RL
fields stay None for SFT. See the Sample contract in DESIGN.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[bool]  # loss_mask[i]: token i is a trained target (predicted from token i-1)
    logprobs: list[float] | None = None  # inference logprobs of completion tokens, 0 elsewhere
    advantage: float | None = None
    reward: float | None = None
    policy_version: int | None = None
    teacher_logprobs: list[float] | None = None
    truncated: bool = False  # cut to max_length by the data source

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"Sample: input_ids has {len(self.input_ids)} tokens but loss_mask has {len(self.loss_mask)}"
            )

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask)


@dataclass
class SampleGroup:
    """The samples of one task (group_size of them); accepted or rejected as a whole."""

    samples: list[Sample] = field(default_factory=list)
    task_id: str | None = None
