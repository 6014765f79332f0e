"""User errors: mistakes the user can fix, which `lit-rl` reports in one message, without a traceback.

A traceback is for a bug in lit-rl or a library; a missing file, a missing column, a hub model
that cannot be downloaded or a bad option value is none of those, and twenty lines of stack
above the one line that matters hide it. So the CLI prints `user_message(exc)` when there is
one and exits 1; everything else keeps its traceback. `LIT_RL_DEBUG=1` shows the traceback of
user errors too.

What counts as a user error is deliberately narrow:
- `UserError`, raised by lit-rl code that knows the user can fix the problem (e.g. a model
  or tokenizer name that cannot be loaded: lit_rl/model_names.py);
- the ValueError in which a data module (StaticDataModule, RolloutDataModule) collects every
  problem of its config;
- an `OSError` raised inside transformers / huggingface_hub (a model or tokenizer loaded by
  code that does not go through lit_rl/model_names.py, say a user's own environment);
- Lightning's `FileNotFoundError` for a `--ckpt_path` that does not exist;
- `ValueError`s raised while the config's classes are built (their `__init__` checks
  argument values) and Lightning's `MisconfigurationException`, both wrapped into a
  `UserError` where they happen (lit_rl/cli.py).
"""

from __future__ import annotations

import os
import traceback

DEBUG_ENV = "LIT_RL_DEBUG"


class UserError(Exception):
    """A problem the user can fix; the message says what is wrong and, when known, the fix."""


class ConfigError(UserError, ValueError):
    """A bad config value found after start-up (e.g. when the trainer builds the schedule);
    a ValueError too, for callers that catch those."""


def debug() -> bool:
    """True when LIT_RL_DEBUG asks for tracebacks of user errors too."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _raised_in(exc: BaseException, packages: tuple[str, ...]) -> bool:
    """Whether the innermost frame of the exception's traceback is in one of `packages`."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    parts = frames[-1].filename.replace("\\", "/").split("/")
    return any(p in parts for p in packages)


HUB_FIX = (
    "fix: check the name; give a local model directory (a run's weights/step_N, or the built-in "
    "lit-rl:tiny_qwen3); or download the model once with network access (`hf download NAME`) "
    "and run with HF_HUB_OFFLINE=1"
)


def user_message(exc: BaseException) -> str | None:
    """The one message to print for a user error, or None when `exc` is not one (a bug)."""
    if isinstance(exc, UserError):
        return str(exc)
    if type(exc) is ValueError and str(exc).startswith(("StaticDataModule: ", "RolloutDataModule: ")):
        return str(exc)
    if isinstance(exc, FileNotFoundError) and str(exc).startswith("Checkpoint file not found"):
        return (f"{exc}\nfix: --ckpt_path last resumes the newest checkpoint of trainer.default_root_dir; "
                "otherwise give the path of an existing .ckpt")
    if isinstance(exc, OSError) and _raised_in(exc, ("transformers", "huggingface_hub")):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"cannot load a model or tokenizer: {first}\n{HUB_FIX}"
    return None
