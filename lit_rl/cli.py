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

from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_rl import stopping
from lit_rl.callbacks.checkpoint import RunCheckpoint
from lit_rl.callbacks.progress import StepProgressBar
from lit_rl.errors import DEBUG_ENV, UserError, debug, user_message
from lit_rl.inference.runtime import InferenceRuntime
from lit_rl.modules.base import CausalLMModule


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


class LitRLCLI(LightningCLI):
    """LightningCLI with lit-rl's defaults.

    - The optimizer is an injected callable on the module (not Lightning's
      auto-configured one, which breaks with `configure_model` and FSDP).
    - Lightning must not swap the sampler: lit-rl datamodules shard their own steps.
    - The saved config of an earlier run in the same directory is overwritten.
    - Logs go to a CSVLogger under `default_root_dir/logs` unless a logger is given.
    - Resumable checkpoints go to `default_root_dir/checkpoints/last.ckpt` (RunCheckpoint)
      unless the config brings its own ModelCheckpoint or disables checkpointing.
    - The progress bar counts optimizer steps of the whole run (StepProgressBar) unless the
      config brings its own or disables it.
    - Every run has one InferenceRuntime, the owner of its inference servers, configured under
      the config's `inference:` section (`--inference.teacher_model ...`); runs that serve no
      model (plain SFT) leave it idle.
    - A config value that a class rejects (a ValueError from its `__init__`, a Lightning
      MisconfigurationException) is a UserError: one message, no traceback.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("parser_kwargs", {"default_env": True, "env_prefix": "LIT_RL", "prog": "lit-rl"})
        defaults = {"use_distributed_sampler": False}
        defaults.update(kwargs.pop("trainer_defaults", None) or {})
        super().__init__(CausalLMModule, LightningDataModule, *args, trainer_defaults=defaults, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(InferenceRuntime, "inference")

    @staticmethod
    def subcommands():
        return {k: v for k, v in LightningCLI.subcommands().items() if k in LIGHTNING_COMMANDS}

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        trainer = config.get("trainer")
        if trainer is not None:
            auto_devices_without_gpu(trainer)
        if trainer is not None and trainer.get("logger") in (None, True):
            root = trainer.get("default_root_dir") or "."
            trainer["logger"] = {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": root, "name": "logs"},
            }

    def instantiate_classes(self) -> None:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as e:
            # jsonargparse wraps what a class's __init__ raised; a ValueError there is an argument check,
            # anything else (a TypeError, say) a bug that keeps its traceback
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            if not isinstance(cause, (ValueError, MisconfigurationException)):
                raise
            raise UserError(f"invalid config: {cause}") from e

    def _instantiate_trainer(self, config, callbacks):
        given = [*(config.get("callbacks") or []), *callbacks]
        if config.get("enable_checkpointing") is not False and not any(isinstance(c, ModelCheckpoint) for c in given):
            callbacks = [*callbacks, RunCheckpoint()]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)


CPU_PROCESSES = 2
MULTI_PROCESS_STRATEGIES = ("ModelParallelStrategy", "FSDPStrategy", "DDPStrategy")


def auto_devices_without_gpu(trainer) -> None:
    """`devices: auto` under a multi-process strategy (configs/strategies/) on a machine without a
    GPU starts 2 CPU processes, where Lightning's `auto` would start 1: a strategy config then
    runs its processes on any machine (every GPU of a GPU machine). `trainer.devices N` chooses."""
    import torch

    strategy = trainer.get("strategy")
    name = strategy.get("class_path", "") if hasattr(strategy, "get") else str(strategy or "")
    multi = name.rsplit(".", 1)[-1] in MULTI_PROCESS_STRATEGIES or name.startswith(("ddp", "fsdp"))
    on_cpu = trainer.get("accelerator") == "cpu" or (trainer.get("accelerator") in (None, "auto") and not torch.cuda.is_available())
    if multi and on_cpu and str(trainer.get("devices")) == "auto":
        trainer["devices"] = CPU_PROCESSES


def quiet_dependency_chatter() -> None:
    """Drop output that says nothing about the run: Lightning's advertising tips ("💡 Tip: ...
    try installing litlogger") and transformers' progress bars, which every weight sync of an RL
    run would print twice ("Writing model shards", "Loading weights"); lit-rl prints its own line
    per checkpoint."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):  # both log info
        logging.getLogger(name).addFilter(lambda record: not str(record.msg).startswith("💡 Tip"))


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
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"unknown command {name!r}{hint}; the commands are {', '.join(COMMANDS)} (lit-rl --help)")
    quiet_dependency_chatter()
    stopping.reset()  # a stop or abort of an earlier run in this process is not this one's
    try:
        LitRLCLI(args=argv)
    except SIGTERMException:
        # stopped by SIGTERM or Ctrl-C after saving a resumable checkpoint
        signum = int(stopping.stopped_by or 15)
        print(stopping.summary(signum), file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    except (KeyboardInterrupt, SystemExit):
        # a second Ctrl-C (Lightning turns one that lands mid-step into exit 1)
        if not stopping.aborted:
            raise
        print(stopping.aborted_summary(), file=sys.stderr, flush=True)
        raise SystemExit(130) from None


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
        if stopping.training_root is not None:  # a run that failed after training started: saved first
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
