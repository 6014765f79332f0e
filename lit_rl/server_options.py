"""The options of a server lit-rl starts (`VLLMServer` keyword arguments, a config's `server:`
mapping): checked before any server starts, and added to by the parts of a run.

Checked: every name must be a `VLLMServer` parameter. Unchecked, a misspelt one reached
`VLLMServer(**options)` only when the run started its servers, after the model and any other server
had loaded, as a TypeError in a traceback (`server_option_problems`).

Added to: several parts of a run each add their own (the sampler's seed, LoRA support, the teacher's top k
and tokenizer), all in the same way: each names the flags that, when the user's `extra_args`
already has one, leave the setting to the user; and `extra_args` given as one string is passed on
untouched, for `VLLMServer` to refuse by name (split into characters, as each adder used to, it
became an unreadable vLLM error).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Sequence

# Set by lit-rl from options of their own (the config's model, its api_key, the run directory).
SET_BY_LIT_RL = ("model", "api_key", "allowed_root")
# What the evaluator's server options take besides: the node's last N GPUs for its server
# (`lit-rl evaluate --server`, `OnlineEval(server=...)`; commands/evaluate.with_gpu_split).
EVALUATOR_SERVER_OPTIONS = ("num_infer_gpus",)


# VLLMServer's parameters of a scalar type, by their annotation (the module has postponed annotations)
SCALAR_TYPES = {"bool": (bool,), "int": (int,), "int | None": (int,), "float": (int, float), "float | None": (int, float)}


def _scalar_types(name: str) -> tuple[type, ...] | None:
    from lit_rl.inference.server import VLLMServer

    parameter = inspect.signature(VLLMServer.__init__).parameters.get(name)
    return None if parameter is None else SCALAR_TYPES.get(str(parameter.annotation))


def _is_a(value, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def typed_server_options(options: dict) -> dict:
    """`options` with the strings given for VLLMServer's bool, int and float parameters read as a
    YAML config reads them. A dotted flag into a config's untyped mapping (`--inference.server.
    enforce_eager false`, `--inference.teacher_server.max_model_len 256`) gives the string
    'false', which is true, or '256', which no check compares with data.max_tokens. A string that
    reads as no such value stays, for `server_option_problems` to name."""
    import yaml

    typed = dict(options)
    for name, value in options.items():
        if isinstance(value, str) and (types := _scalar_types(name)):
            try:
                read = yaml.safe_load(value)
            except yaml.YAMLError:
                continue
            if _is_a(read, types):
                typed[name] = read
    return typed


def server_option_problems(options: dict, where: str, also: Iterable[str] = ()) -> list[str]:
    """What is wrong with `options` for a server lit-rl starts, one line per option, each starting
    with where they came from and the option's name (`where`: "inference.server.", "--server "): a
    name `VLLMServer` takes no parameter for (with the closest one it takes), one lit-rl sets
    itself, or `extra_args` as one string or naming a flag `VLLMServer` passes vLLM itself. `also`:
    names the caller accepts besides (the evaluator's `num_infer_gpus`)."""
    from lit_rl.inference.server import VLLMServer, extra_args_problem, server_value_problems

    parameters = inspect.signature(VLLMServer.__init__).parameters
    accepted = [name for name in parameters if name not in ("self", *SET_BY_LIT_RL)] + list(also)
    problems, typed = [], {}
    for name, value in options.items():
        if name in SET_BY_LIT_RL:
            problems.append(f"{name} is not a server option here: lit-rl sets it (the model, the api_key and the "
                            "run directory have options of their own)")
        elif name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1)
            problems.append(f"{name} is not a server option{f' (did you mean {close[0]}?)' if close else ''}; "
                            f"the options are {', '.join(accepted)}")
        elif (types := _scalar_types(name)) and value is not None and not _is_a(value, types):
            problems.append(f"{name} must be {' or '.join(t.__name__ for t in types)}, got {value!r}")
        else:
            typed[name] = value
    problems += server_value_problems(typed)  # those vLLM would refuse once started
    if problem := extra_args_problem(options.get("extra_args", ()), options.get("dev_mode", True)):
        problems.append(problem)
    return [where + problem for problem in problems]


def completion_room_problem(max_tokens: int, options: dict, *, what: str, where: str) -> str | None:
    """A completion limit that leaves no room for a prompt in the server's `max_model_len`, which
    counts prompt and completion tokens together. vLLM (0.32) answers a request whose max_tokens is
    above max_model_len with a 400, so a run (or an eval) would start its server and then fail every
    request; at max_model_len it cuts every completion to what the prompt leaves, shorter than asked,
    without a word. `what` names the limit ("data.max_tokens"), `where` the server's options
    ("inference.server.")."""
    model_len = options.get("max_model_len")
    if isinstance(model_len, int) and max_tokens >= model_len:
        return (f"{what} ({max_tokens}) leaves no room for a prompt in {where}max_model_len ({model_len}), which "
                "counts prompt and completion tokens together: lower the one or raise the other")
    return None


def evaluator_server_problems(options: dict, envs: Iterable, where: str) -> list[str]:
    """What is wrong with the options of the evaluator's server (`OnlineEval(server=...)`, `lit-rl
    evaluate --server`): `server_option_problems`, with the evaluator's own options accepted, and
    `completion_room_problem` for each eval environment that samples with its own `max_tokens` (the
    built-in `Environment.evaluate`; a custom `evaluate` decides itself what it asks of the server:
    HeldOutLoss asks nothing)."""
    from lit_rl.rollouts.envs import Environment

    problems = server_option_problems(options, where=where, also=EVALUATOR_SERVER_OPTIONS)
    room = (completion_room_problem(env.sampling.max_tokens, options, what=f"environment {env.name}'s max_tokens",
                                    where=where) for env in envs if type(env).evaluate is Environment.evaluate)
    return problems + [p for p in room if p]


def names_flag(extra_args: Sequence[str] | str | None, flags: Sequence[str]) -> bool:
    """Whether vLLM arguments `extra_args` give one of `flags` (`--flag value` or `--flag=value`);
    False for a string, which is refused by name (`server_option_problems`)."""
    return not isinstance(extra_args, str) and any(str(a).split("=")[0] in flags for a in extra_args or ())


def loads_weights(extra_args: Sequence[str] | str | None) -> bool:
    """Whether the server reads the model's weight files: not with a `--load-format` of the user's
    (`dummy`, say), which lets a directory without weights be served."""
    return not names_flag(extra_args, ("--load-format",))


def with_server_args(options: dict, args: Sequence[str], *, unless: Sequence[str] = ()) -> dict:
    """`options` with `args` appended to their `extra_args`, unless those already name one of the
    flags `unless` (`--flag value` or `--flag=value`) or are a string."""
    extra = options.get("extra_args", ())
    if isinstance(extra, str) or names_flag(extra, unless):
        return options
    return {**options, "extra_args": [*extra, *args]}
