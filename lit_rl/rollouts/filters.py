"""Rollout filters: flag degenerate completions, and optionally keep them out of the loss.

A policy that drifts can start emitting gibberish (long runs of tokens the model itself
found very unlikely) or loop (the same span over and over until `max_tokens`). Training on
such samples tends to make it worse. Each filter here always *measures* (the buffer counts
flagged samples in its metrics), and only *enforces* when asked: an enforced filter zeroes
the sample's loss (loss_mask all False, ``metadata["filtered"] = name``). The sample keeps
its reward and stays in its group, so the group's baseline is unchanged; it just trains
nothing. Flagged samples list the filters that flagged them in ``metadata["flags"]``.

The "completion" of a sample is its trained tokens (loss_mask True), in order: for a
single-turn rollout exactly the sampled completion; for a multi-turn one the model's turns.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from lit_rl.data.samples import Sample


class RolloutFilter(Protocol):
    name: str
    enforce: bool

    def check(self, sample: Sample) -> bool:
        """True when the sample is degenerate by this filter's measure."""


@dataclass(frozen=True)
class GibberishFilter:
    """At least `run` consecutive completion tokens each sampled with logprob < `threshold`.

    At temperature 1 a healthy model rarely samples a token it gives probability below
    e^-9 (about 1e-4), and almost never several in a row; a run of them is noise, not text
    (a random-init model samples near log(1/vocab) ~ -12 at every step). Samples without
    sampling logprobs (`has_sampling_logprobs` False) are exempt: there is nothing to read.
    """

    threshold: float = -9.0
    run: int = 8
    enforce: bool = False
    name: ClassVar[str] = "gibberish"

    def __post_init__(self) -> None:
        if not isinstance(self.run, int) or self.run < 1:
            raise ValueError(f"GibberishFilter: run must be an int >= 1, got {self.run!r}")

    def check(self, sample: Sample) -> bool:
        if not sample.has_sampling_logprobs:
            return False
        length = 0
        for logprob, target in zip(sample.logprobs, sample.loss_mask):
            length = length + 1 if target and logprob < self.threshold else 0
            if length >= self.run:
                return True
        return False


@dataclass(frozen=True)
class RepetitionFilter:
    """Some `ngram` of completion token ids occurs at least `min_count` times (overlapping).

    A count of one repeated n-gram, rather than a fraction of repeated n-grams, because it
    catches a loop however long the rest of the answer is, and its meaning is plain: with the
    defaults, the same 16 tokens four times. A loop of period p <= 16 repeats every 16-gram
    inside it once per period, so it is flagged after about 4 periods; ordinary prose and
    most code do not repeat a 16-token span four times.
    """

    ngram: int = 16
    min_count: int = 4
    enforce: bool = False
    name: ClassVar[str] = "repetition"

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.ngram, int) or self.ngram < 1:
            problems.append(f"ngram must be an int >= 1, got {self.ngram!r}")
        if not isinstance(self.min_count, int) or self.min_count < 2:
            problems.append(f"min_count must be an int >= 2, got {self.min_count!r}")
        if problems:
            raise ValueError("RepetitionFilter: " + "; ".join(problems))

    def check(self, sample: Sample) -> bool:
        ids = [t for t, target in zip(sample.input_ids, sample.loss_mask) if target]
        counts: Counter[tuple[int, ...]] = Counter()
        for i in range(len(ids) - self.ngram + 1):
            key = tuple(ids[i : i + self.ngram])
            counts[key] += 1
            if counts[key] >= self.min_count:
                return True
        return False


def default_filters() -> tuple[RolloutFilter, ...]:
    """Both filters, measuring only (no enforcement)."""
    return (GibberishFilter(), RepetitionFilter())


def mark_filtered(sample: Sample, name: str) -> Sample:
    """A copy that trains nothing (loss_mask all False), labelled with the filter's name."""
    return dataclasses.replace(
        sample, loss_mask=[False] * len(sample.loss_mask), metadata={**sample.metadata, "filtered": name}
    )


@dataclass
class FilterResult:
    samples: list[Sample]  # the input samples, flagged ones labelled and enforced ones zeroed
    flagged: dict[str, int]  # filter name -> samples it flagged
    enforced: int  # samples whose loss was zeroed


def apply_filters(samples: Sequence[Sample], filters: Sequence[RolloutFilter]) -> FilterResult:
    """Run every filter on every sample (all are measured); the first enforced filter that
    flags a sample zeroes its loss."""
    flagged = {f.name: 0 for f in filters}
    out, enforced = [], 0
    for sample in samples:
        hits = [f for f in filters if f.check(sample)]
        for f in hits:
            flagged[f.name] += 1
        if hits:
            sample = dataclasses.replace(sample, metadata={**sample.metadata, "flags": [f.name for f in hits]})
        enforcing = next((f for f in hits if f.enforce), None)
        if enforcing is not None:
            sample = mark_filtered(sample, enforcing.name)
            enforced += 1
        out.append(sample)
    return FilterResult(out, flagged, enforced)
