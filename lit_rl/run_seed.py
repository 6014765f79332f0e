"""The run's seed (`seed_everything`), for the randomness lit-rl draws outside torch's generators.

Lightning's `seed_everything(N)` (LightningCLI's `seed_everything: N`) seeds Python, NumPy and
torch, and records N in the `PL_GLOBAL_SEED` environment variable, which every rank inherits.
Two sources of randomness in an RL run are not seeded by it: the rollout buffer's task order
(a string-seeded `random.Random`, stable across processes) and the sampling of the vLLM server
lit-rl starts (vLLM's own `--seed`, 0 unless told). Both follow this seed unless set
explicitly, so that runs of two seeds draw different tasks and different samples, as the runs of
two seeds of a peer trainer do; before they did, every seed of a run drew the same tasks from a
server seeded 0, and its runs differed only by the server's scheduling.
"""

from __future__ import annotations

import os

SEED_VARIABLE = "PL_GLOBAL_SEED"  # lightning.fabric.utilities.seed


def run_seed() -> int:
    """The seed `seed_everything` was given in this process (or its launcher); 0 when none was."""
    value = os.environ.get(SEED_VARIABLE, "")
    try:
        return int(value)
    except ValueError:
        return 0


def with_sampler_seed(options: dict, seed: int) -> dict:
    """vLLM server options whose sampler is seeded `seed`, unless their `extra_args` set `--seed`."""
    extra = list(options.get("extra_args", ()))
    if any(a.split("=")[0] == "--seed" for a in extra):
        return options
    return {**options, "extra_args": [*extra, "--seed", str(seed)]}
