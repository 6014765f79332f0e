"""Graceful stops of a training run: a SIGTERM or a first Ctrl-C never loses work.

Lightning turns SIGTERM into `trainer.received_sigterm` (`RunCheckpoint` does the same for the
first Ctrl-C), and its loop raises `SIGTERMException` at the end of the current step. A second
Ctrl-C aborts at once (`abort_now`), even mid-save: the servers are still stopped, the checkpoint
being written is dropped (it is written under a temporary name, so the last one stays whole), and
the exit is 130 with a line naming the last checkpoint there is (`aborted_summary`). A run with inference servers has more places that wait on a server, and the
servers may be going down at the same moment (a scheduler's SIGTERM often reaches every process
of the job), so the rules are:

- waiting gives way: a step waiting for its rollouts, or a server still starting, stops waiting
  as soon as a stop is asked for (`requested`), and the step is abandoned before anything of it
  was trained (the rollout buffer keeps every finished group: popping a batch is atomic);
- a server error once a stop was asked for is that stop, not a failure (`stops_on_request`);
- nothing is synced to a server after the last step of a stopped run;
- whoever stops the servers saves first (`save_before_stopping`): the resumable checkpoint, with
  the rollout buffer's state, is written while everything still runs, and only then are the
  servers and the evaluator stopped (requests in flight aborted, SIGTERM, SIGKILL after a grace
  period). Servers a run starts therefore ignore this process's SIGTERM
  (`VLLMServer(stop_on_sigterm=False)`); atexit and the parent-death signal still cover them.

The exit code is 128 + the signal (143 for SIGTERM, 130 for Ctrl-C), and `lit_rl.cli` prints where
the checkpoint is and how to resume as the last line (`summary`).

A fatal error once a step was trained (a server that is gone for good, rollouts failing past
their reject budget, a non-finite gradient) saves the same way before anything stops
(`saves_on_failure`): then the run exits 1 with one message, the cause and how to resume
(`failure_summary`), and the traceback goes to `<run>/error.log`. Under several processes a
checkpoint is a collective, so only an error that every rank raises at the same point is saved:
rank 0's errors of the batch and of the weight sync are broadcast for that (`raise_on_every_rank`,
`RunFailed`); any other error of one rank saves nothing (the last checkpoint is named).
"""

from __future__ import annotations

import logging
import signal
import traceback
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

#: the signal that stopped the last run gracefully, and the checkpoint it saved (read by `lit_rl.cli`)
stopped_by: int | None = None
saved_checkpoint: str | None = None
stopped_at_step: int | None = None
#: a second Ctrl-C cut the stop short; the newest checkpoint there is then, and its step
aborted: bool = False
latest_checkpoint: tuple[str, int] | None = None
#: the training run in progress (set when training starts, cleared when it ends): its directory
#: and the step it started from; an error while it is set is a failure of a started run
training_root: str | None = None
started_at_step: int = 0


class RunFailed(RuntimeError):
    """A fatal error of rank 0 (waiting for a batch, syncing weights), raised on every rank at the
    same point so that they write the run's checkpoint together before it stops."""


def reset(resumed_from: tuple[str, int] | None = None, root: str | None = None, step: int = 0) -> None:
    global stopped_by, saved_checkpoint, stopped_at_step, aborted, latest_checkpoint, training_root, started_at_step
    stopped_by = saved_checkpoint = stopped_at_step = None
    aborted, latest_checkpoint = False, resumed_from
    training_root, started_at_step = root, step


def abort_now(signum, frame) -> None:
    """The second Ctrl-C's handler: stop waiting for the graceful stop."""
    global aborted
    aborted = True
    raise KeyboardInterrupt


def requested(trainer) -> bool:
    """Whether a SIGTERM or a first Ctrl-C asked this run to stop."""
    return bool(trainer is not None and getattr(trainer, "received_sigterm", False))


def stop(trainer, why: str) -> SIGTERMException:
    """The exception that stops the run gracefully (saved, then exit 128 + signal)."""
    global stopped_by
    stopped_by = stopped_by or signal.SIGTERM
    log.info("stopping: %s", why)
    return SIGTERMException()


@contextmanager
def stops_on_request(trainer, what: str):
    """Inside: an error once a stop was asked for is that stop (the servers may be going down with
    the job), raised as `SIGTERMException`; otherwise errors pass through unchanged."""
    try:
        yield
    except SIGTERMException:
        raise
    except Exception as e:
        if not requested(trainer):
            raise
        raise stop(trainer, f"{what} ended by the stop ({type(e).__name__}: {str(e)[:200]})") from None


def failure_cause(what: str, error: BaseException) -> str:
    """The message every rank raises for rank 0's `error` (`RunFailed`)."""
    return f"{what}: {type(error).__name__}: {error}"


def raise_on_every_rank(trainer, error: BaseException | None, what: str) -> None:
    """Collective: rank 0's `error` (None: none) reaches every rank. On one process the error is
    raised as it is; on several every rank raises `RunFailed` with its message (rank 0's chained
    to it), so that they save together (`saves_on_failure`)."""
    if trainer.world_size == 1:
        if error is not None:
            raise error
        return
    message = trainer.strategy.broadcast(failure_cause(what, error) if error is not None else None, src=0)
    if message is not None:
        raise RunFailed(message) from error


def saves_on_failure(trainer, exception: BaseException | None) -> bool:
    """Whether `exception` ends a run whose checkpoint is written first: an error (not a stop or
    a second Ctrl-C) after a step of this run was trained, raised on every rank together (on one
    process, any error; on several, `RunFailed`)."""
    if not isinstance(exception, Exception) or training_root is None:
        return False
    if trainer.global_step <= started_at_step:  # nothing trained since the last checkpoint or the start
        return False
    return trainer.world_size == 1 or isinstance(exception, RunFailed)


def save_before_stopping(trainer, exception: BaseException | None) -> None:
    """Write the resumable checkpoint of a graceful stop or of a fatal error now, before servers or
    the evaluator are stopped (idempotent: the checkpoint callback's own `on_exception` then finds
    it written)."""
    failed = saves_on_failure(trainer, exception)
    if not (failed or isinstance(exception, SIGTERMException)):
        return
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        save = getattr(callback, "save_on_failure" if failed else "save_on_stop", None)
        if callable(save):
            save(trainer)


def summary(signum: int) -> str:
    """The last line of a stopped run: which signal, the step, the checkpoint, how to resume."""
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    if saved_checkpoint is None:
        return f"lit-rl: stopped by {name}; no checkpoint was written (checkpointing is off)"
    return (f"lit-rl: stopped by {name} after step {stopped_at_step}; resumable checkpoint: {saved_checkpoint}; "
            "resume: the same command with --ckpt_path last")


def failure_summary(exception: BaseException, message: str) -> str:
    """What a run that failed after training started prints: the cause (`message`), where its
    checkpoint is and how to resume, and where the traceback went (`<run>/error.log`)."""
    lines = [message]
    if saved_checkpoint is not None:
        lines.append(f"lit-rl: resumable checkpoint written after the error: {saved_checkpoint} (step {stopped_at_step}); "
                     "resume: the same command with --ckpt_path last")
    elif latest_checkpoint is not None:
        path, step = latest_checkpoint
        lines.append(f"lit-rl: no checkpoint was written for this error; the last one is {path} (step {step}); "
                     "resume: the same command with --ckpt_path last")
    else:
        lines.append("lit-rl: no checkpoint of this run was written")
    if training_root is not None:
        log_path = Path(training_root) / "error.log"
        try:
            log_path.write_text("".join(traceback.format_exception(exception)))
            lines.append(f"(the traceback is in {log_path}; LIT_RL_DEBUG=1 prints it)")
        except OSError:
            lines.append("(set LIT_RL_DEBUG=1 to see the traceback)")
    return "\n".join(lines)


def aborted_summary() -> str:
    """The last line of a run a second Ctrl-C aborted."""
    if saved_checkpoint is not None:
        return summary(signal.SIGINT) + " (the second Ctrl-C only cut the shutdown short)"
    if latest_checkpoint is None:
        return "lit-rl: aborted by a second Ctrl-C before any checkpoint of this run was written"
    path, step = latest_checkpoint
    return (f"lit-rl: aborted by a second Ctrl-C before the stop's checkpoint was written; the last checkpoint is "
            f"{path} (step {step}); resume: the same command with --ckpt_path last")
