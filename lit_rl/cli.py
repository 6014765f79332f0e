"""The `lit-rl` command: LightningCLI's `fit` and `validate`, plus lit-rl's own commands.

`lit-rl fit --config sft.yaml --trainer.max_steps 100` is plain LightningCLI: the
module and datamodule are chosen by `class_path`, every field can be overridden with
a dotted flag or an `LIT_RL_*`-style environment variable (see docs/cli.md), and
`--print_config` shows the whole resolved config. Commands that are not Lightning
trainer entry points (`lit-rl data ...`) live beside them under the same name; `lit-rl
--help` lists them all (COMMANDS).

A user's mistake (a missing file or column, a model that cannot be downloaded, a bad
option value) is reported in one message without a traceback; see lit_rl/errors.py.
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import NamedTuple

from lit_rl.errors import DEBUG_ENV, UserError, debug, user_message


class Command(NamedTuple):
    summary: str
    example: str
    module: str | None  # None: a LightningCLI subcommand


COMMANDS = {
    "fit": Command("train a model from a config (SFT, GRPO, on-policy distillation)",
                   "lit-rl fit --config examples/reverse_text/sft.yaml --trainer.max_steps 100", None),
    "validate": Command("the validation loss on data.val_path or data.val_split",
                        "lit-rl validate --config examples/reverse_text/sft.yaml", None),
    "data": Command("show the rows of a config as they will be trained, trained tokens marked",
                    "lit-rl data preview --config examples/reverse_text/sft.yaml --rows 2", "lit_rl.commands.data"),
    "serve": Command("run a vLLM server in the foreground, for configs that take a base_url",
                     "lit-rl serve --model runs/reverse_text_sft/weights/step_100", "lit_rl.commands.serve"),
    "evaluate": Command("evaluate the exported checkpoints of a run",
                        "lit-rl evaluate --weights-dir runs/reverse_text_sft/weights --env lit_rl.rollouts.ReverseTextEnv",
                        "lit_rl.commands.evaluate"),
    "report": Command("plot a run's training and eval curves to a PNG",
                      "lit-rl report runs/reverse_text_sft", "lit_rl.commands.report"),
}
LIGHTNING_COMMANDS = tuple(name for name, c in COMMANDS.items() if c.module is None)
EXTRA_COMMANDS = {name: c.module for name, c in COMMANDS.items() if c.module is not None}


def usage() -> str:
    """The top-level help: every command, one line each, with an example."""
    width = max(map(len, COMMANDS))
    lines = [
        "usage: lit-rl COMMAND [options]",
        "",
        "Post-training for LLMs on PyTorch Lightning. `lit-rl COMMAND --help` shows a command's options.",
        "",
        "commands:",
    ]
    for name, c in COMMANDS.items():
        lines += [f"  {name:<{width}}  {c.summary}", f"  {'':<{width}}    e.g. {c.example}"]
    lines += [
        "",
        "fit and validate take any config field as a dotted flag (--trainer.max_steps 50) or an environment",
        "variable (LIT_RL_FIT__TRAINER__MAX_STEPS=50); --print_config shows the resolved config.",
        f"{DEBUG_ENV}=1 shows the traceback of an error that is reported as one message. Docs: docs/cli.md",
    ]
    return "\n".join(lines)


def missing_config_file(args: list[str]) -> str | None:
    """The first `--config`/`-c` value that is neither a file nor an inline YAML mapping (which
    jsonargparse also takes): its own refusal of a missing file comes after a usage message of every
    flag of the command, some 200 lines."""
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(("--config=", "-c=")):
            value = arg.split("=", 1)[1]
        else:
            continue
        if not os.path.isfile(value) and not value.lstrip().startswith(("{", "[")) and ":" not in value:
            return value
    return None


def refuse_missing_config_file(args: list[str]) -> None:
    if (missing := missing_config_file(args)) is not None:
        raise UserError(f"--config {missing}: no such file (a relative path is read from the working directory, "
                        f"{os.getcwd()})")


def unknown_command(name: str, commands, prog: str) -> UserError:
    """`prog`'s error for a command it does not have, with the closest one it has."""
    close = difflib.get_close_matches(name, commands, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    of = "" if prog == "lit-rl" else f" of {prog}"
    return UserError(f"unknown command {name!r}{of}{hint}; the commands are {', '.join(commands)} ({prog} --help)")


def run_command(args: list[str], argv: list[str] | None) -> None:
    """Dispatch to a lit-rl command or to LightningCLI (which reads sys.argv itself when `argv` is None)."""
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        raise SystemExit(0 if args else 2)
    name = args[0]
    if name in EXTRA_COMMANDS:
        import importlib

        importlib.import_module(EXTRA_COMMANDS[name]).main(args[1:])
        return
    if name not in COMMANDS and not name.startswith("-"):
        raise unknown_command(name, COMMANDS, "lit-rl")
    refuse_missing_config_file(args)
    from lit_rl.lightning_cli import run_lightning  # here: the other commands start without Lightning

    run_lightning(argv)


def main(argv: list[str] | None = None) -> None:
    # Class paths in configs may name the user's own modules (a custom eval, say) relative to
    # the working directory, as with `python -m`; the console script alone would not see them.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        run_command(args, argv)
    except Exception as e:
        message = user_message(e)
        command = f" {args[0]}" if args and args[0] in COMMANDS else ""
        stopping = sys.modules.get("lit_rl.stopping")  # imported by every run that trains
        if stopping is not None and stopping.training_root is not None:  # failed after training started: saved first
            from lightning.pytorch.utilities.rank_zero import rank_zero_only

            if rank_zero_only.rank == 0:
                cause = message or f"{type(e).__name__}: {e}"
                print(stopping.failure_summary(e, f"lit-rl{command}: error: {cause}"), file=sys.stderr, flush=True)
            if debug():
                raise
            raise SystemExit(1) from None
        if message is None or debug():
            raise
        print(f"lit-rl{command}: error: {message}\n(set {DEBUG_ENV}=1 to see the traceback)", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
