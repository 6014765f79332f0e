"""What a rollout gets: the client, the tokenizer, the training sampling settings, the version.

Training samples are not eval samples: a rollout for GRPO draws at temperature 1 with no
per-request seed (a fixed seed would give the same completions at every step), while an
environment's own `Sampling` (temperature 0, seed 0 by default) stays the eval setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def sampling_problems(max_tokens: int, temperature: float, top_p: float, top_k: int | None, *,
                      prefix: str = "") -> list[str]:
    """What is wrong with training sampling settings, each field named as `prefix` + its name (a
    config's `data.` fields have the same names). vLLM would refuse them only at the first request,
    after the servers started."""
    problems = []
    if max_tokens < 1:
        problems.append(f"{prefix}max_tokens must be >= 1, got {max_tokens}")
    if not temperature >= 0:
        problems.append(f"{prefix}temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        problems.append(f"{prefix}top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < -1:
        problems.append(f"{prefix}top_k must be -1, 0 (both: off), >= 1 or null, got {top_k}")
    return problems


@dataclass(frozen=True)
class TrainSampling:
    """Sampling settings for training rollouts (not evals)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None  # None: a fresh draw every request (a fixed seed repeats samples across steps)

    def __post_init__(self) -> None:
        if problems := sampling_problems(self.max_tokens, self.temperature, self.top_p, self.top_k):
            raise ValueError("TrainSampling: " + "; ".join(problems))

    def request_kwargs(self) -> dict:
        """Keyword arguments for `InferenceClient.generate`."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed}


@dataclass
class RolloutContext:
    """Handed to `Environment.rollout(task, ctx)` for one task.

    `client` is an `InferenceClient` of the policy's server; `tokenizer` renders chats the
    way training does; `group_size` samples are expected back; `policy_version` is the
    weights version the scheduler recorded when this rollout was spawned (the buffer stamps
    it on every sample, so a rollout function need not).
    """

    client: Any  # lit_rl.inference.client.InferenceClient
    tokenizer: Any
    sampling: TrainSampling
    group_size: int
    policy_version: int
    chat_template_kwargs: dict = field(default_factory=dict)
