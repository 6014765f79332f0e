"""LitRLCLI: LightningCLI with lit-rl's defaults, behind `lit-rl fit` and `lit-rl validate`.

Apart from `lit_rl/cli.py` so that lit-rl's other commands (`serve`, `evaluate`, `report`, the
online evaluator's process) and `lit-rl --help` start without importing Lightning (about 4 s of
CPU a start on a 2-core machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch import Callback, LightningDataModule
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_rl import stopping
from lit_rl.callbacks.checkpoint import RunCheckpoint, last_checkpoints
from lit_rl.callbacks.progress import StepProgressBar
from lit_rl.cli import LIGHTNING_COMMANDS
from lit_rl.errors import UserError
from lit_rl.inference.runtime import InferenceRuntime
from lit_rl.modules.base import CausalLMModule
from lit_rl.run_dir import earlier_run


class LitRLCLI(LightningCLI):
    """LightningCLI with lit-rl's defaults.

    - The optimizer is an injected callable on the module (not Lightning's
      auto-configured one, which breaks with `configure_model` and FSDP).
    - Lightning must not swap the sampler: lit-rl datamodules shard their own steps.
    - The saved config of an earlier run in the same directory is overwritten.
    - Logs go to a CSVLogger under `default_root_dir/logs` unless a logger is given (given to the
      trainer, not written into the config, whose saved copy must run again into another directory).
    - Resumable checkpoints go to `default_root_dir/checkpoints/last.ckpt` (RunCheckpoint)
      unless the config brings its own ModelCheckpoint or disables checkpointing.
    - The progress bar counts optimizer steps of the whole run (StepProgressBar) unless the
      config brings its own or disables it.
    - Every run has one InferenceRuntime, the owner of its inference servers, configured under
      the config's `inference:` section (`--inference.teacher_model ...`); runs that serve no
      model (plain SFT) leave it idle.
    - A config value that a class rejects (a ValueError from its `__init__`, a Lightning
      MisconfigurationException) is a UserError: one message, no traceback.
    - A launch that trains nothing and logs nothing (a data file the datamodule refuses, a
      `--ckpt_path` that does not exist, a resume refused after its checkpoint was restored, a
      resume at `max_steps`) leaves no `logs/version_N` behind: Lightning creates the logger's
      directory before the datamodule's setup (and the config is saved there), and each such
      attempt would push the next run's logs one version on.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("save_config_callback", SaveRunConfig)
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

    def _set_seed(self) -> None:
        refuse_seed_out_of_range(self._get(self.config, "seed_everything"))
        super()._set_seed()

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        trainer = config.get("trainer")
        if trainer is not None:
            auto_devices_without_gpu(trainer)
            refuse_automatic_optimization_flags(trainer)

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

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            self._resolve_last_checkpoint(subcommand)
            super()._run_subcommand(subcommand)
        except BaseException as e:
            self._refuse_unreadable_checkpoint(e)  # read when the trainer restores it
            raise
        finally:
            remove_empty_log_dir(self.trainer)

    def _parse_ckpt_path(self) -> None:
        """Lightning's reads a given checkpoint whole at start-up (weights and optimizer state, in
        CPU memory) for the model's saved `__init__` arguments, before the trainer loads it again to
        restore it. lit-rl's modules save none (their arguments are the config's), so nothing is
        read here: a resume of a large model loads its checkpoint once. `last` is looked up once the
        trainer (its checkpoint callbacks) exists: `_resolve_last_checkpoint`."""

    def _resolve_last_checkpoint(self, subcommand: str) -> None:
        """`--ckpt_path last` that finds no checkpoint. Lightning only warns and starts from step 0,
        and the fresh start then replaces the run it was meant to resume (HFExport removes its
        exported weights): refused, before anything is written, when the run directory holds an
        earlier run. A requeue script passes `last` to every launch of a job, the first one
        included: into a run directory without one, it starts fresh. `validate` (and Lightning's other
        commands) has nothing to start: without a checkpoint it would run the untrained model, refused."""
        config = self.config_init[subcommand]
        if config.get("ckpt_path") != "last" or last_checkpoints(self.trainer):
            return
        root = self.trainer.default_root_dir
        if subcommand != "fit":  # validate, test, predict: the model as built (untrained) is not what was asked
            raise UserError(f"--ckpt_path last found no checkpoint in the run directory {root} "
                            f"({self._where_checkpoints_go()}): `lit-rl {subcommand}` would run the model the config "
                            f"builds, untrained. fix: give the checkpoint with --ckpt_path PATH, or the run's "
                            "--trainer.default_root_dir")
        earlier = earlier_run(root)
        if earlier:
            raise UserError(f"--ckpt_path last found no checkpoint to resume ({self._where_checkpoints_go()}), but the run directory "
                            f"{root} holds an earlier run ({'; '.join(earlier)}); starting from step 0 would replace "
                            "it, its exported weights included. fix: give the checkpoint to resume with --ckpt_path "
                            "PATH; or leave out --ckpt_path to start a fresh run that replaces it; or set "
                            "--trainer.default_root_dir to another directory")
        rank_zero_info(f"--ckpt_path last: no checkpoint yet in the run directory {root}: starting from step 0")
        config["ckpt_path"] = None  # Lightning's warning about it would advise `ModelCheckpoint(save_last=True)`

    def _where_checkpoints_go(self) -> str:
        callbacks = [c for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        return (f"none in {', '.join(str(c.dirpath) for c in callbacks)}" if callbacks else
                "this config writes none: trainer.enable_checkpointing is false")

    def _refuse_unreadable_checkpoint(self, e: BaseException) -> None:
        """torch's error on a checkpoint file cut short (a full disk, a copy that stopped) is a
        traceback from inside Lightning; say which checkpoint, and what to do. So is the error on a
        sharded checkpoint (FSDP2's: a directory) read by another strategy."""
        subcommand = self.config.get("subcommand")
        given = (self.config.get(subcommand) or {}).get("ckpt_path") if subcommand else None
        if isinstance(e, RuntimeError) and "PytorchStreamReader failed" in str(e):
            raise UserError(f"cannot read the checkpoint (--ckpt_path {given}): it is truncated or corrupt "
                            f"({str(e).split('. ')[0]}); fix: resume from another checkpoint, or start a fresh run") from e
        if isinstance(e, IsADirectoryError) and (Path(e.filename or "") / ".metadata").is_file():
            raise UserError(f"the checkpoint {e.filename} (--ckpt_path {given}) is a sharded FSDP2 checkpoint, a "
                            "directory that only the FSDP2 strategy reads; fix: resume with --config "
                            "configs/strategies/fsdp2.yaml (any --trainer.devices, 1 included)") from e

    def _instantiate_trainer(self, config, callbacks):
        from lit_rl.callbacks.export import HFExport

        given = [*(config.get("callbacks") or []), *callbacks]
        if sum(isinstance(c, HFExport) for c in given) > 1:
            raise UserError("invalid config: trainer.callbacks has more than one lit_rl.callbacks.HFExport; one "
                            "exports every checkpoint of a run (the weight syncs and online evals use it too): "
                            "keep one, with the options of both")
        if config.get("enable_checkpointing") is not False and not any(isinstance(c, ModelCheckpoint) for c in given):
            callbacks = [*callbacks, RunCheckpoint()]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks = [*callbacks, StepProgressBar()]
        callbacks = [*callbacks, TrainingStart()]
        if config.get("logger") in (None, True):
            # the trainer's, not the config's: the saved config.yaml keeps `logger: null`, and a rerun of it
            # with another default_root_dir logs there, not into the run it was saved from
            config = {**config, "logger": CSVLogger(save_dir=config.get("default_root_dir") or ".", name="logs")}
        return super()._instantiate_trainer(config, callbacks)


SAVED_CONFIG_MARK = "# lit-rl: this launch's resolved config (replaced by the next launch into this run directory)"


class SaveRunConfig(SaveConfigCallback):
    """The launch's config, saved inside the run directory whatever the logger. Lightning saves it in
    `trainer.log_dir`: `logs/version_N` for its CSV and TensorBoard loggers, but any other logger's
    `save_dir`, which for W&B is the working directory by default, and with no logger
    (`trainer.logger: false`) `default_root_dir`, the working directory when unset: where `config.yaml`
    is often the user's own config, replaced without a word (overwrite is on, so that a rerun can
    start). There it goes to `<run dir>/config.yaml` instead, marked as lit-rl's on its first line and
    replaced by each launch; a `config.yaml` there without the mark (the user's own, when the run
    directory is the working directory) is left as it is, and the config goes to `run_config.yaml`."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        logger = trainer.loggers[0] if trainer.loggers else None
        if self.already_saved or isinstance(logger, (CSVLogger, TensorBoardLogger)):
            return super().setup(trainer, pl_module, stage)  # logs/version_N
        if trainer.is_global_zero:
            root = Path(trainer.default_root_dir)
            root.mkdir(parents=True, exist_ok=True)
            path = root / self.config_filename
            if path.exists() and not path.read_text(errors="replace").startswith(SAVED_CONFIG_MARK):
                path = root / f"run_{self.config_filename}"
                rank_zero_warn(f"{root / self.config_filename} is not a config lit-rl saved (your own?): left as it "
                               f"is; this launch's config is in {path}")
            path.write_text(SAVED_CONFIG_MARK + "\n" + self.parser.dump(self.config, skip_none=False))
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)


class TrainingStart(Callback):
    """Notes the optimizer step this launch's training started from (the checkpoint's, on a
    resume); None until training starts. A launch that ends there trained nothing."""

    def __init__(self):
        self.step: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def trained_in_this_launch(trainer) -> bool:
    """Whether this launch trained an optimizer step (from step 0 without `TrainingStart`)."""
    start = next((c.step for c in trainer.callbacks if isinstance(c, TrainingStart)), 0)
    return start is not None and trainer.global_step > start


def remove_empty_log_dir(trainer) -> None:
    """Remove the logger's version directory of a launch that trained nothing, when it holds
    nothing but the config this launch saved there (a `--ckpt_path` that does not exist fails
    after that; a resume refused after its checkpoint was restored, or one at `max_steps`, trains
    nothing), and the `logs` directory above it if that is then empty. A directory with anything
    else in it (metrics, a user's notes), or of a launch that trained a step (and logged none), is
    left as it is."""
    import contextlib
    import shutil

    if trainer is None or trainer.global_rank != 0 or trained_in_this_launch(trainer):
        return
    log_dir = getattr(trainer.logger, "log_dir", None)
    if not isinstance(log_dir, str) or not Path(log_dir).is_dir():
        return
    log_dir = Path(log_dir)
    if any(p.name != "config.yaml" or p.is_dir() for p in log_dir.iterdir()):
        return
    shutil.rmtree(log_dir)
    if log_dir.parent.name == "logs":
        with contextlib.suppress(OSError):
            log_dir.parent.rmdir()  # only an empty directory


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


def refuse_seed_out_of_range(seed) -> None:
    """Lightning's `seed_everything` refuses a seed numpy cannot take with a traceback that does not
    name the flag; say which flag, and the range (Lightning's)."""
    from lightning.fabric.utilities.seed import max_seed_value, min_seed_value

    if isinstance(seed, int) and not isinstance(seed, bool) and not min_seed_value <= seed <= max_seed_value:
        raise UserError(f"invalid config: seed_everything ({seed}) must be in [{min_seed_value}, {max_seed_value}], "
                        "the seeds numpy takes (true draws one at random)")


def refuse_automatic_optimization_flags(trainer) -> None:
    """Lightning's gradient accumulation and clipping flags belong to its automatic optimization,
    which lit-rl's modules do not use (their step splits each batch into micro-batches and clips
    itself): Lightning's own refusal is a traceback that says to switch to automatic
    optimization, which a user cannot do. Say instead which of lit-rl's options does the job."""
    problems = []
    if trainer.get("accumulate_grad_batches") not in (None, 1):
        problems.append(f"trainer.accumulate_grad_batches ({trainer['accumulate_grad_batches']}): every lit-rl "
                        "optimizer step already accumulates the gradients of its whole batch (data.batch_size "
                        "rows or samples) over micro-batches of at most data.micro_batch_tokens tokens; for larger "
                        "steps raise data.batch_size")
    if trainer.get("gradient_clip_val") not in (None, 0, 0.0) or trainer.get("gradient_clip_algorithm") is not None:
        problems.append(f"trainer.gradient_clip_val ({trainer.get('gradient_clip_val')}), "
                        f"trainer.gradient_clip_algorithm ({trainer.get('gradient_clip_algorithm')}): lit-rl clips "
                        "the global gradient norm itself at model.init_args.max_grad_norm (1.0 by default; null "
                        "disables it); leave both trainer flags unset")
    if problems:
        raise UserError("invalid config: " + "; ".join(problems))


def quiet_dependency_chatter() -> None:
    """Drop output that says nothing about the run: Lightning's advertising tips ("💡 Tip: ...
    try installing litlogger") and transformers' progress bars, which every weight sync of an RL
    run would print twice ("Writing model shards", "Loading weights"); lit-rl prints its own line
    per checkpoint. And three warnings, each with a file path into site-packages, that no user can act
    on: Lightning's "You defined a `validation_step` but have no `val_dataloader`" (every RL run: RL
    data modules have no validation loader by design), its "Total length of `list` across ranks is
    zero" (an SFT run without held-out data: StaticDataModule's validation loader is then empty),
    and torch 2.13's deprecation of what Lightning 2.6's pytree helper calls."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message="You defined a `validation_step` but have no `val_dataloader`")
    warnings.filterwarnings("ignore", message="Total length of `list` across ranks is zero")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):  # both log info
        logging.getLogger(name).addFilter(lambda record: not str(record.msg).startswith("💡 Tip"))


def run_lightning(argv: list[str] | None) -> None:
    """`lit-rl fit` / `validate`: LightningCLI (which reads sys.argv itself when `argv` is None),
    with lit-rl's exits for a stop (SIGTERM or Ctrl-C: 128 + the signal, after the checkpoint)
    and for a second Ctrl-C that aborted the stop's save (130)."""
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
