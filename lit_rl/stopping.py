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
"""

from __future__ import annotations

import logging
import signal
from contextlib import contextmanager

from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

#: the signal that stopped the last run gracefully, and the checkpoint it saved (read by `lit_rl.cli`)
stopped_by: int | None = None
saved_checkpoint: str | None = None
stopped_at_step: int | None = None
#: a second Ctrl-C cut the stop short; the newest checkpoint there is then, and its step
aborted: bool = False
latest_checkpoint: tuple[str, int] | None = None


def reset(resumed_from: tuple[str, int] | None = None) -> None:
    global stopped_by, saved_checkpoint, stopped_at_step, aborted, latest_checkpoint
    stopped_by = saved_checkpoint = stopped_at_step = None
    aborted, latest_checkpoint = False, resumed_from


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


def save_before_stopping(trainer, exception: BaseException | None) -> None:
    """Write the resumable checkpoint of a graceful stop now, before servers or the evaluator are
    stopped (idempotent: the checkpoint callback's own `on_exception` then finds it written)."""
    if not isinstance(exception, SIGTERMException):
        return
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        save = getattr(callback, "save_on_stop", None)
        if callable(save):
            save(trainer)


def summary(signum: int) -> str:
    """The last line of a stopped run: which signal, the step, the checkpoint, how to resume."""
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    if saved_checkpoint is None:
        return f"lit-rl: stopped by {name}; no checkpoint was written (checkpointing is off)"
    return (f"lit-rl: stopped by {name} after step {stopped_at_step}; resumable checkpoint: {saved_checkpoint}; "
            "resume: the same command with --ckpt_path last")


def aborted_summary() -> str:
    """The last line of a run a second Ctrl-C aborted."""
    if saved_checkpoint is not None:
        return summary(signal.SIGINT) + " (the second Ctrl-C only cut the shutdown short)"
    if latest_checkpoint is None:
        return "lit-rl: aborted by a second Ctrl-C before any checkpoint of this run was written"
    path, step = latest_checkpoint
    return (f"lit-rl: aborted by a second Ctrl-C before the stop's checkpoint was written; the last checkpoint is "
            f"{path} (step {step}); resume: the same command with --ckpt_path last")
