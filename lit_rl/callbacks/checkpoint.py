"""RunCheckpoint: resumable Lightning checkpoints in `<default_root_dir>/checkpoints/`.

`last.ckpt` (model, optimizer, scheduler, step, data position) is written every
`every_n_train_steps` optimizer steps, after the last step, and when the run is
stopped by SIGTERM or Ctrl-C, so `lit-rl fit ... --ckpt_path last` resumes exactly.
The file is written under a temporary name and renamed: a kill mid-write never leaves
a truncated `last.ckpt`. Under a sharded strategy (FSDP2 with
`save_distributed_checkpoint`, FSDP1 with `state_dict_type: sharded`) `last.ckpt` is a
folder with one file per rank; it is written and renamed the same way, the old folder
set aside until the new one is in place.

Ctrl-C is made graceful: the first press finishes the current optimizer step, saves and
exits (code 130); a second press aborts at once, even mid-save (the last whole checkpoint
stays; the exit line names it). SIGTERM does the same (code 143). In a run
with inference servers the save comes before any server stops (`lit_rl.stopping`).
A fatal error after a step was trained saves `last.ckpt` too, before the run stops (exit 1).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from contextlib import contextmanager
from weakref import proxy

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_rl import stopping
from lit_rl.errors import ConfigError
from lit_rl.run_dir import earlier_run, fsync_written

log = logging.getLogger(__name__)


def _replace(new: str, path: str) -> None:
    """`os.replace`, also for sharded checkpoints (FSDP2 and FSDP1 write a folder, one file per
    rank), which cannot replace a folder or file in one rename: the old one is renamed aside
    and removed once the new one is in place."""
    if os.path.exists(path) and (os.path.isdir(path) or os.path.isdir(new)):
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(new, path)
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    else:
        os.replace(new, path)


class CheckpointWriteError(OSError):
    """Writing `last.ckpt` failed (disk full, unwritable directory); the one before is intact."""


def last_checkpoints(trainer) -> set[str]:
    """The checkpoints that `ckpt_path="last"` chooses from, found as Lightning finds them
    (`_CheckpointConnector._parse_ckpt_path`)."""
    found = {getattr(c, "ckpt_path", None) for c in trainer.callbacks if isinstance(c, OnExceptionCheckpoint)}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, RunCheckpoint):
            found |= callback.last_checkpoints(trainer)
        elif isinstance(callback, ModelCheckpoint):
            found |= callback._find_last_checkpoints(trainer)
    return {path for path in found if path and os.path.exists(path)}


@contextmanager
def _epoch_cut_short_left_open(trainer):
    """While the checkpoint of a run's end is written: an epoch that `max_steps` (or a stop
    request) cut short before its data ran out counts as not completed, as in a checkpoint saved
    during the epoch. Lightning closes the epoch before `on_train_end`, and a run resumed from the
    checkpoint would count a new epoch while its data module goes on with the same data epoch: it
    logged `epoch` one higher than the same run uninterrupted."""
    loop = trainer.fit_loop
    total = loop.epoch_progress.total
    cut = (total.completed > 0 and total.ready == total.started == total.processed == total.completed
           and not loop.epoch_loop.batch_progress.is_last_batch)
    trackers = (loop.epoch_progress.total, loop.epoch_progress.current) if cut else ()
    for tracker in trackers:
        tracker.processed -= 1
        tracker.completed -= 1
    try:
        yield
    finally:
        for tracker in trackers:
            tracker.processed += 1
            tracker.completed += 1


@contextmanager
def _validation_left_open(trainer):
    """While the checkpoint of a stop asked for during validation is written: the validation counts
    as interrupted inside a batch, which is how Lightning's restart recognises a checkpoint saved
    mid-evaluation (`_EvaluationLoop.update_restart_stage`) and runs that validation before the next
    step, and none of its batches counts as done, so that it runs over all of them (a restarted
    evaluation goes through its data from the start but stops as many batches early as it counted
    done: 7 of 8, another `val/loss`). Lightning stops a validation after any batch but the last once
    a SIGTERM (or lit-rl's first Ctrl-C) came, with every batch so far counted as done; a run resumed
    from that checkpoint skipped the validation, and its `val/` metrics of that step were never
    logged (the uninterrupted run has them)."""
    progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
    total, current = progress.total, progress.current
    cut = (trainer.validating and not trainer.sanity_checking and total.completed > 0
           and total.ready == total.started == total.processed == total.completed)
    kept = current.state_dict()
    if cut:
        total.processed -= 1
        total.completed -= 1
        current.reset()
    try:
        yield
    finally:
        if cut:
            total.processed += 1
            total.completed += 1
            current.load_state_dict(kept)


class RunCheckpoint(ModelCheckpoint):
    def __init__(self, dirpath: str | None = None, every_n_train_steps: int | None = 100, **kwargs):
        """
        Args:
            dirpath: where checkpoints go; default ``<default_root_dir>/checkpoints``.
            every_n_train_steps: refresh ``last.ckpt`` every N optimizer steps (None: only at
                the end and on SIGTERM / Ctrl-C).
            **kwargs: other ``ModelCheckpoint`` arguments (``save_top_k`` defaults to 0 here:
                only ``last.ckpt`` is kept; ``enable_version_counter`` to False: a fresh run in
                the directory of an earlier one overwrites its ``last.ckpt``, as it replaces
                its exported steps, instead of writing ``last-v1.ckpt`` beside it).
        """
        kwargs.setdefault("save_top_k", 0)
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(dirpath=dirpath, save_last=True, every_n_train_steps=every_n_train_steps, **kwargs)
        self._previous_sigint = None

    def _default_dirpath(self, trainer) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")

    def last_checkpoints(self, trainer) -> set[str]:
        """This callback's `last.ckpt` if there is one (what `ckpt_path="last"` finds here)."""
        self._default_dirpath(trainer)
        return super()._find_last_checkpoints(trainer)

    def _find_last_checkpoints(self, trainer):
        """Where Lightning's `trainer.fit(ckpt_path="last")` looks, before anything is written. With
        no checkpoint to resume, Lightning only warns and starts from step 0, and the fresh start
        replaces the run it was meant to resume (HFExport removes its exported weights): refused when
        the run directory holds an earlier run (`lit-rl fit --ckpt_path last` refuses it first, in
        its flags' words); into a directory without one it starts fresh."""
        found = self.last_checkpoints(trainer)
        if not found and trainer.state.fn == TrainerFn.FITTING and not last_checkpoints(trainer):
            root = trainer.default_root_dir
            if earlier := earlier_run(root):
                raise ConfigError(f'ckpt_path="last" found no checkpoint to resume (none in {self.dirpath}), but the run '
                                  f"directory {root} holds an earlier run ({'; '.join(earlier)}); starting from step 0 "
                                  "would replace it, its exported weights included. fix: pass the checkpoint to resume "
                                  "as ckpt_path; or ckpt_path=None to start a fresh run that replaces it; or another "
                                  "default_root_dir")
        return found

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._default_dirpath(trainer)
        super().setup(trainer, pl_module, stage)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        partial = filepath + ".part"
        if os.path.isdir(partial):  # a sharded save that was killed: its files must not mix with this one's
            if trainer.is_global_zero:
                shutil.rmtree(partial)
            trainer.strategy.barrier("run_checkpoint_clean")
        try:
            trainer.save_checkpoint(partial, self.save_weights_only)
        except BaseException as e:  # e.g. a second Ctrl-C: no half-written file is left beside last.ckpt
            if os.path.isfile(partial):
                os.remove(partial)
            if isinstance(e, OSError):  # a full disk: Lightning's write names no file
                raise CheckpointWriteError(f"RunCheckpoint: could not write {filepath}: {type(e).__name__}: {e}") from e
            raise
        if trainer.is_global_zero:
            fsync_written(partial)  # every rank's part is written: saving is collective
            _replace(partial, filepath)
        trainer.strategy.barrier("run_checkpoint")
        stopping.latest_checkpoint = (filepath, trainer.global_step)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _save_last_now(self, trainer) -> None:
        if self._last_global_step_saved != trainer.global_step or not self._last_checkpoint_saved:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = self._every_n_train_steps
        if n and trainer.global_step % n == 0:
            self._save_last_now(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        with _epoch_cut_short_left_open(trainer):
            self._save_last_now(trainer)
        self._restore_sigint()
        stopping.training_root = None  # errors from here on are not failures of the training

    def on_validation_end(self, trainer, pl_module) -> None:
        pass  # last.ckpt follows optimizer steps, not validation

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass

    # ---- graceful stops ----------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self._align_logged_steps(trainer)
        resumed = trainer.ckpt_path if trainer.ckpt_path and os.path.exists(trainer.ckpt_path) else None
        stopping.reset(resumed_from=(resumed, trainer.global_step) if resumed else None,
                       root=trainer.default_root_dir, step=trainer.global_step)

        def first_ctrl_c(signum, frame):
            stopping.stopped_by = signal.SIGINT
            rank_zero_info("\nCtrl-C: finishing this step, saving a checkpoint, then stopping (Ctrl-C again aborts now)")
            trainer._signal_connector.received_sigterm = True  # Lightning stops at the end of the step
            signal.signal(signal.SIGINT, stopping.abort_now)

        try:
            self._previous_sigint = signal.signal(signal.SIGINT, first_ctrl_c)
        except ValueError:  # not the main thread: leave Ctrl-C alone
            self._previous_sigint = None

    @staticmethod
    def _align_logged_steps(trainer) -> None:
        """A resume from a checkpoint saved at the end of a step that ran validation (after the last
        step, or on a stop) goes on logging each step one too high (steps 7-10 for 6-9). Lightning's
        restart takes such a checkpoint for one of its ModelCheckpoint's, saved in that validation,
        before the step was counted among the logged ones: it skips the validation and counts the
        step again. Counted one lower here, it lands where the uninterrupted run's count was. The
        restart's own test decides (whether validation is due at the restored step, with this run's
        settings); Lightning's own checkpoints there, one count lower already, are left alone."""
        loop = trainer.fit_loop.epoch_loop
        if (loop.restarting and loop.restarted_on_last and loop._batches_that_stepped == trainer.global_step
                and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)):
            loop._batches_that_stepped -= 1

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def save_on_stop(self, trainer) -> None:
        """The checkpoint of a graceful stop (idempotent); `lit_rl.stopping` calls it before any
        server is stopped, `on_exception` otherwise."""
        stopping.stopped_by = stopping.stopped_by or signal.SIGTERM
        with _validation_left_open(trainer):
            self._save_before_exit(trainer, "stopping: checkpoint written")

    def save_on_failure(self, trainer) -> None:
        """The checkpoint of a run that fails after training started (`stopping.saves_on_failure`;
        idempotent). A failure to write it is logged, and the run's own error is what is raised."""
        loop = trainer.fit_loop.epoch_loop
        progress = loop.batch_progress.total
        # Failed inside a step: Lightning, restarting from a checkpoint, counts one more logged step
        # unless it was saved at a step's end, so the count is saved one lower (the resumed run then
        # logs its first step under the number of the step that failed, as an uninterrupted run).
        mid_step = int(progress.processed < progress.started)
        loop._batches_that_stepped -= mid_step
        try:
            self._save_before_exit(trainer, "the run failed; checkpoint written first")
        except Exception as e:
            log.error("RunCheckpoint: could not write the checkpoint after the run failed: %r", e)
        finally:
            loop._batches_that_stepped += mid_step

    def _save_before_exit(self, trainer, what: str) -> None:
        if stopping.saved_checkpoint is not None and stopping.stopped_at_step == trainer.global_step:
            return
        self._save_last_now(trainer)
        stopping.saved_checkpoint = self._last_checkpoint_saved
        stopping.stopped_at_step = trainer.global_step
        rank_zero_info(f"{what}: {self._last_checkpoint_saved} (step {trainer.global_step})")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_sigint()
        if isinstance(exception, SIGTERMException):
            self.save_on_stop(trainer)
        elif stopping.saves_on_failure(trainer, exception):
            self.save_on_failure(trainer)
