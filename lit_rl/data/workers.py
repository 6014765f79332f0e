"""How many DataLoader worker processes render the next steps: ``num_workers: auto``.

A worker renders rows (chat template, tokenizer, packing) while the model trains, which is free
only when it has a core of its own. Training on a CPU where torch's threads already take every
core, the worker preempts one of them and the other waits at the next barrier: measured on 2
cores (docs/benchmarks.md), one worker left lit-rl at 0.90-0.91x a bare loop over the same
batches, rendering inline at 0.95-0.97x. So ``auto`` renders inline (0 workers) there and uses
one worker everywhere else (a GPU run, or spare cores).
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. under taskset or a SLURM allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_num_workers(num_workers: int | str, field: str = "data.num_workers") -> int:
    """`num_workers` as a number: ``auto`` is 0 when training on CPU with torch's intra-op threads
    on every usable core, else 1; a number is used as it is."""
    if num_workers == "auto":
        cpu_only = not torch.cuda.is_available()
        return 0 if cpu_only and torch.get_num_threads() >= usable_cores() else 1
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"{field} must be 'auto' or a number >= 0, got {num_workers!r}")
    return num_workers
