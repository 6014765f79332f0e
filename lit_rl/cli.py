"""The `lit-rl` command: LightningCLI's `fit` and `validate`, plus lit-rl's own commands.

`lit-rl fit --config sft.yaml --trainer.max_steps 100` is plain LightningCLI: the
module and datamodule are chosen by `class_path`, every field can be overridden with
a dotted flag or an `LIT_RL_*`-style environment variable (see docs/cli.md), and
`--print_config` shows the whole resolved config. Commands that are not Lightning
trainer entry points (`lit-rl data ...`) live beside them under the same name.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_rl.callbacks import checkpoint

from lit_rl.modules.base import CausalLMModule

LIGHTNING_COMMANDS = ("fit", "validate")
EXTRA_COMMANDS = {
    "data": "lit_rl.commands.data",
    "serve": "lit_rl.commands.serve",
    "evaluate": "lit_rl.commands.evaluate",
    "report": "lit_rl.commands.report",
}


class LitRLCLI(LightningCLI):
    """LightningCLI with lit-rl's defaults.

    - The optimizer is an injected callable on the module (not Lightning's
      auto-configured one, which breaks with `configure_model` and FSDP).
    - Lightning must not swap the sampler: lit-rl datamodules shard their own steps.
    - The saved config of an earlier run in the same directory is overwritten.
    - Logs go to a CSVLogger under `default_root_dir/logs` unless a logger is given.
    - Resumable checkpoints go to `default_root_dir/checkpoints/last.ckpt` (RunCheckpoint)
      unless the config brings its own ModelCheckpoint or disables checkpointing.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("parser_kwargs", {"default_env": True, "env_prefix": "LIT_RL"})
        defaults = {"use_distributed_sampler": False}
        defaults.update(kwargs.pop("trainer_defaults", None) or {})
        super().__init__(CausalLMModule, LightningDataModule, *args, trainer_defaults=defaults, **kwargs)

    @staticmethod
    def subcommands():
        return {k: v for k, v in LightningCLI.subcommands().items() if k in LIGHTNING_COMMANDS}

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        trainer = config.get("trainer")
        if trainer is not None and trainer.get("logger") in (None, True):
            root = trainer.get("default_root_dir") or "."
            trainer["logger"] = {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": root, "name": "logs"},
            }


    def _instantiate_trainer(self, config, callbacks):
        given = [*(config.get("callbacks") or []), *callbacks]
        if config.get("enable_checkpointing") is not False and not any(isinstance(c, ModelCheckpoint) for c in given):
            callbacks = [*callbacks, checkpoint.RunCheckpoint()]
        return super()._instantiate_trainer(config, callbacks)


def main(argv: list[str] | None = None) -> None:
    # Class paths in configs may name the user's own modules (a custom eval, say) relative to
    # the working directory, as with `python -m`; the console script alone would not see them.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in EXTRA_COMMANDS:
        import importlib

        importlib.import_module(EXTRA_COMMANDS[args[0]]).main(args[1:])
        return
    try:
        LitRLCLI(args=argv)  # None: LightningCLI reads sys.argv itself
    except SIGTERMException:
        # stopped by SIGTERM or Ctrl-C after saving a resumable checkpoint
        raise SystemExit(128 + int(checkpoint.stopped_by or 15)) from None


if __name__ == "__main__":
    main()
