"""Names of the models that ship inside lit-rl: `lit-rl:tiny_qwen3` works from any directory.

A config names its model or tokenizer as a hub name (`Qwen/Qwen3-0.6B`), a local directory,
or a built-in model (`lit-rl:<name>`, a directory under `lit_rl/assets/` of the installed
package). `resolve_model_name` turns a built-in name into that directory and leaves every
other name alone; it is called wherever a name reaches `from_pretrained` or vLLM, so a saved
config keeps the portable name rather than one machine's path. `load_tokenizer` (and
`load_causal_lm`) resolve the name and turn transformers' raw `OSError` for a name that
cannot be loaded (not a local directory, and the hub unreachable or without it) into a
`UserError` that names it and says how to fix it.

The old spelling `lit_rl/assets/tiny_qwen3`, relative to the repository root, keeps working
from anywhere: when no such directory exists where the command runs, it means the built-in one.
"""

from __future__ import annotations

import os
from pathlib import Path

from lit_rl.errors import UserError
from lit_rl.run_dir import step_of

PREFIX = "lit-rl:"
ASSETS = Path(__file__).resolve().parent / "assets"
_OLD_PREFIX = "lit_rl/assets/"


def builtin_models() -> list[str]:
    """Every built-in model name, e.g. ``["lit-rl:tiny_qwen3"]``."""
    return sorted(PREFIX + p.name for p in ASSETS.iterdir() if (p / "config.json").is_file())


def resolve_model_name(name: str | os.PathLike) -> str:
    """The directory of a built-in model (``lit-rl:NAME``), or ``name`` unchanged."""
    name = os.fspath(name)
    if name.startswith(PREFIX):
        path = ASSETS / name[len(PREFIX):]
        if not (path / "config.json").is_file():
            raise UserError(f"unknown built-in model {name!r}; the built-in models are {builtin_models()}")
        return str(path)
    old = name.replace(os.sep, "/")
    if old.startswith(_OLD_PREFIX) and not os.path.isdir(name) and (ASSETS / old[len(_OLD_PREFIX):].rstrip("/")).is_dir():
        return str(ASSETS / old[len(_OLD_PREFIX):].rstrip("/"))
    return name


def missing_local_model(name: str | os.PathLike) -> bool:
    """Whether `name` can only be a local directory (absolute, `./`, `../`, `~`, or with more than
    one `/`: a hub name is ORG/NAME) and there is none: said at once instead of after the hub's
    own error about repository ids."""
    path = resolve_model_name(name)
    if os.path.isdir(path):
        return False
    return os.path.isabs(path) or path.startswith((".", "~")) or path.replace(os.sep, "/").count("/") > 1


NO_SUCH_DIRECTORY = "no such directory (a hub name is ORG/NAME)"
WEIGHT_FILES = ("safetensors", "bin", "pt")  # what vLLM's default loader reads from a directory


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def in_hub_cache(name: str) -> bool:
    """Whether the hub cache holds `name`'s config.json (what an offline vLLM needs to find it)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a repo id at all (e.g. a path with too many parts)
        return False


def local_model_problem(name: str | os.PathLike, *, weights: bool = False) -> str | None:
    """Why `name` is no model vLLM can serve, to follow the name in a message (it starts with ": "
    or " "): a path with no directory there, a directory without `config.json` (naming the
    newest checkpoint in it when it is a run's `weights/`), and with `weights` one without weight
    files (the built-in models are a config and a tokenizer, trained from `random_init`), and a hub
    name while the hub is switched off (HF_HUB_OFFLINE=1) that its cache does not hold. None for a
    model directory or a hub name it can get. vLLM says so only after its start-up, in a traceback of its own."""
    if missing_local_model(name):
        return f": {NO_SUCH_DIRECTORY}"
    path = Path(resolve_model_name(name))
    if not path.is_dir() and hub_offline() and not in_hub_cache(str(name)):
        return (" is not a local directory, and the hub is switched off (HF_HUB_OFFLINE=1) with no copy of it in the "
                "hub cache: check the name; or download it once with network access (`hf download NAME`)")
    if not path.is_dir() or (path / "params.json").is_file():
        return None
    if (path / "config.json").is_file():
        if not weights or any(next(path.glob(f"*.{ext}"), None) for ext in WEIGHT_FILES):
            return None
        return (" has no weights (no " + ", ".join(f"*.{ext}" for ext in WEIGHT_FILES) + " files): "
                + ("a built-in model is a config and a tokenizer to train from random_init; " if path.parent == ASSETS
                   else "") + "serve a checkpoint, e.g. a run's <run>/weights/step_N")
    steps = sorted((step_of(p), p) for p in path.iterdir() if step_of(p) is not None and (p / "config.json").is_file())
    if steps:
        return f" holds checkpoints, not a model: give one of them, e.g. {steps[-1][1]}"
    return " has no config.json: not a model directory (a run's checkpoints are <run>/weights/step_N)"


def not_loadable(name: str | os.PathLike, what: str, error: OSError) -> UserError:
    """The UserError for transformers' OSError on loading `name` (the user's spelling)."""
    name = os.fspath(name)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    path = resolve_model_name(name)
    if missing_local_model(name):  # a path, not a hub name: no download to suggest
        return UserError(f"cannot load the {what} {name!r}: {NO_SUCH_DIRECTORY}")
    if os.path.isdir(path):
        return UserError(f"cannot load the {what} in directory {name!r}: {first}\n"
                         f"fix: point to a complete HF checkpoint directory (config.json, tokenizer files, weights)")
    offline = hub_offline()
    where = "the hub is switched off (HF_HUB_OFFLINE=1)" if offline else "it could not be fetched from the hub"
    return UserError(
        f"cannot load the {what} {name!r}: it is not a local directory and {where} ({first})\n"
        f"fix: check the name; give a local directory (a run's weights/step_N, or the built-in {PREFIX}tiny_qwen3); "
        f"or download it once with network access (`hf download {name}`) and keep HF_HUB_OFFLINE=1"
    )


def load_tokenizer(name: str | os.PathLike, **kwargs):
    """`AutoTokenizer.from_pretrained` for a hub name, a directory or a built-in name."""
    from transformers import AutoTokenizer

    path = resolve_model_name(name)
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as e:
        raise not_loadable(name, "tokenizer", e) from e
    except ValueError as e:  # a directory without tokenizer files: "Couldn't instantiate the backend tokenizer"
        if os.path.isdir(path):
            raise not_loadable(name, "tokenizer", e) from e
        raise
