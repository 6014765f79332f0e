"""The run's seed (`seed_everything`), for the randomness lit-rl draws outside torch's generators.

Lightning's `seed_everything(N)` (LightningCLI's `seed_everything: N`) seeds Python, NumPy and
torch, and records N in the `PL_GLOBAL_SEED` environment variable, which every rank inherits.
Two kinds of randomness lit-rl draws are not seeded by it: the order of the rows and tasks a run
trains on (an SFT data module's and a replay source's row order, each from a generator seeded
for it so that a position is all a resume needs; the rollout buffer's task order, a
string-seeded `random.Random`, stable across processes) and the sampling of the vLLM server
lit-rl starts (vLLM's own `--seed`, 0 unless told). Both follow this seed unless set explicitly,
so that runs of two seeds draw different rows, tasks and samples, as the runs of two seeds of a
peer trainer do (transformers' Trainer shuffles with its `seed`); before they did, every seed
of a run saw the same rows in the same order (and in RL drew from a server seeded 0).
"""

from __future__ import annotations

import os

from lit_rl.errors import ConfigError
from lit_rl.server_options import with_server_args

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
    return with_server_args(options, ["--seed", str(seed)], unless=["--seed"])


def order_seed(explicit: int | None, saved: int | None, *, flag: str, announce: bool = True) -> int:
    """The seed a row or task order is drawn from: `explicit` (the `flag` option) when set, else
    the one a resumed run started with (`saved`, from its checkpoint), else the run's seed.

    A resume keeps its order because the seed a launch gets may differ from the first
    launch's, and a new order in the middle of a pass over the data would repeat some rows and
    skip others; for the same reason an explicit seed that differs from the saved one is refused
    (a ConfigError: the user's flag, one message).
    """
    if explicit is not None:
        if saved is not None and saved != explicit:
            raise ConfigError(
                f"{flag} is {explicit}, but the checkpoint's run drew its order with seed {saved}: another "
                f"order in the middle of a pass would repeat some rows and skip others; leave {flag} unset "
                f"(the saved seed is kept) or set it to {saved}"
            )
        return explicit
    if saved is None:
        return run_seed()
    if announce and saved != run_seed():
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"{flag}: resuming the order of seed {saved}, the one the run started with "
                       f"(this launch's seed_everything is {run_seed()})")
    return saved


def saved_order_seed(state: dict, explicit: int | None) -> int:
    """The seed a checkpoint's order was drawn with: `state["seed"]`; a checkpoint from before
    lit-rl saved it drew with the option's seed `explicit`, whose default was then 0."""
    return int(state["seed"]) if "seed" in state else (0 if explicit is None else explicit)
