"""Entry point of the vLLM servers lit-rl starts: vLLM's own OpenAI server, with one setting
vLLM does not expose, changed by patching a private class of vLLM (the only patch lit-rl makes
to vLLM, and only when `LIT_RL_VLLM_SPIN_S` is set: lit-rl sets it on CPU builds).

vLLM's engine core and worker talk through shared-memory queues whose readers spin-wait
(`os.sched_yield()` in a loop) for `busy_loop_s` = 1 s after every message before they sleep on a
socket (`shm_broadcast.SpinCondition`, hard-coded). On a GPU node that costs a spare CPU core for
a second; on a CPU-only machine it takes a core from the trainer after every batch of rollouts
(measured in docs/benchmarks.md, GRPO step: 1.3-1.6x slower steps on 2 cores). When
`LIT_RL_VLLM_SPIN_S` is set, every reader spins that long instead: `SpinCondition.__init__` is
wrapped so that its `busy_loop_s` default is that value (checked against vLLM 0.32's signature;
on a vLLM without that parameter nothing is changed and a warning says so). The patch runs at import, so
it holds in vLLM's forked processes (inherited) and in spawned ones (multiprocessing re-imports
the parent's `__main__`, this module, as `__mp_main__` in the child; vLLM spawns its engine core
and CPU worker).

Once vLLM's server has returned (its shutdown is complete), the process runs its atexit hooks and
leaves with `os._exit`, skipping the interpreter's own teardown: a server once hung there after
"Application shutdown complete" (nanobind's leak report printed, its engine gone) until it was
killed, and one whose parent had died (PR_SET_PDEATHSIG's SIGTERM was its only stop) was left
behind for good.

    python -m lit_rl.inference.vllm_main --model ... (any `vllm.entrypoints.openai.api_server` argument)
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import runpy
import sys
import traceback

SPIN_ENV = "LIT_RL_VLLM_SPIN_S"


def set_spin_wait(seconds: float) -> bool:
    """Make vLLM's shared-memory queue readers spin `seconds` after a read instead of 1 s.
    Returns False (and changes nothing) when this vLLM has no such knob."""
    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "SpinCondition", None)
    if spin is None or "busy_loop_s" not in inspect.signature(spin.__init__).parameters:
        return False
    original = getattr(spin.__init__, "__wrapped__", spin.__init__)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if len(args) < 4:  # (is_reader, context, notify_address, busy_loop_s): not given positionally
            kwargs.setdefault("busy_loop_s", seconds)
        original(self, *args, **kwargs)

    spin.__init__ = __init__
    return True


if __name__ in ("__main__", "__mp_main__") and os.environ.get(SPIN_ENV):  # the server and its children only
    if not set_spin_wait(float(os.environ[SPIN_ENV])):
        logging.getLogger(__name__).warning(
            "%s is set but this vLLM has no SpinCondition(busy_loop_s); its readers keep their own spin", SPIN_ENV)


def exit_now(code: object) -> None:
    """Leave as the interpreter would with `sys.exit(code)`, but after the atexit hooks only."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    exit_code: object = 0
    try:
        # alter_sys=False keeps this module as __main__, so the processes vLLM spawns import it again
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=False)
    except SystemExit as e:
        exit_code = e.code
    except BaseException:
        traceback.print_exc()
        exit_code = 1
    exit_now(exit_code)
