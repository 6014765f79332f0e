"""Adding vLLM arguments to the options of a server lit-rl starts (`VLLMServer` keyword arguments).

Several parts of a run each add their own (the sampler's seed, LoRA support, the teacher's top k
and tokenizer), all in the same way: each names the flags that, when the user's `extra_args`
already has one, leave the setting to the user; and `extra_args` given as one string is passed on
untouched, for `VLLMServer` to refuse by name (split into characters, as each adder used to, it
became an unreadable vLLM error).
"""

from __future__ import annotations

from collections.abc import Sequence


def with_server_args(options: dict, args: Sequence[str], *, unless: Sequence[str] = ()) -> dict:
    """`options` with `args` appended to their `extra_args`, unless those already name one of the
    flags `unless` (`--flag value` or `--flag=value`) or are a string."""
    extra = options.get("extra_args", ())
    if isinstance(extra, str) or any(a.split("=")[0] in unless for a in extra):
        return options
    return {**options, "extra_args": [*extra, *args]}
