"""Entry point of the vLLM servers lit-rl starts: vLLM's own OpenAI server, with two settings vLLM
does not expose, changed by patching vLLM's classes (the only patches lit-rl makes to vLLM, each
only when its variable is set: lit-rl sets them on CPU builds).

Spin-wait (`LIT_RL_VLLM_SPIN_S`). vLLM's engine core and worker talk through shared-memory queues
whose readers spin-wait (`os.sched_yield()` in a loop) for `busy_loop_s` = 1 s after every message
before they sleep on a socket (`shm_broadcast.SpinCondition`, hard-coded). On a GPU node that costs
a spare CPU core for a second; on a CPU-only machine it takes a core from the trainer after every
batch of rollouts (measured in docs/benchmarks.md, GRPO step: 1.3-1.6x slower steps on 2 cores).
When the variable is set, every reader spins that long instead: `SpinCondition.__init__` is
wrapped so that its `busy_loop_s` default is that value (checked against vLLM 0.32's signature;
on a vLLM without that parameter nothing is changed and a warning says so). The patch runs at
import, so it holds in vLLM's forked processes (inherited) and in spawned ones (multiprocessing
re-imports the parent's `__main__`, this module, as `__mp_main__` in the child).

Engine start (`LIT_RL_VLLM_FORK_ENGINE`). vLLM's async server always runs its engine core in a
process of its own, started the way `VLLM_WORKER_MULTIPROC_METHOD` says: fork by default, but the
CPU platform sets spawn unconditionally (`CpuPlatform.check_and_update_config`), so the engine
core starts a new interpreter and imports vLLM, torch and transformers again, 8-9 s of CPU at
every start on 2 cores. With lit-rl's one-process layout (`cpu_engine.py`: the single-process
executor, nothing further to start) the engine core is forked from the API server as on a GPU
server: that method is wrapped to set fork back after it, when the executor is "uni". The API
server has run no model by then (no OpenMP threads to lose in the child), and the completions,
logprobs and reloads are the spawned engine's (bench/server_start.py). What a fork copies that a
spawn does not: the API server's HTTP socket, bound before the engine starts. The child lets go
of it at once (`drop_inherited_sockets`): kept, it held the port open after the API process was
killed alone, and a run waited on requests nobody answered (tests/test_faults.py timed out).

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
import socket
import sys
import traceback

from lit_rl.inference.server_env import FORK_ENV, FORKED, SPIN_ENV, START_METHOD


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


def spin_wait_from_environment() -> None:
    """`set_spin_wait` with `LIT_RL_VLLM_SPIN_S`'s value, when it is set."""
    if os.environ.get(SPIN_ENV) and not set_spin_wait(float(os.environ[SPIN_ENV])):
        logging.getLogger(__name__).warning(
            "%s is set but this vLLM has no SpinCondition(busy_loop_s); its readers keep their own spin", SPIN_ENV)


if __name__ in ("__main__", "__mp_main__"):  # the server and its children only
    spin_wait_from_environment()


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


def fork_engine_core() -> bool:
    """On vLLM's CPU platform, start the engine core by fork when its executor is the single-process
    one (lit-rl's one-process layout, `cpu_engine.py`). Returns False (and changes nothing) when this
    vLLM has no CPU platform class to wrap."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return False
    original = getattr(getattr(CpuPlatform, "check_and_update_config", None), "__func__", None)
    if original is None:
        return False

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)  # sets VLLM_WORKER_MULTIPROC_METHOD=spawn, whatever the layout
        if vllm_config.parallel_config.distributed_executor_backend == "uni":  # nothing else to start
            os.environ[START_METHOD] = "fork"
            print(FORKED, file=sys.stderr, flush=True)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    # Every child this process forks lets go of the API server's socket (a spawned one never had it).
    port = api_port(sys.argv)
    os.register_at_fork(after_in_child=lambda: drop_inherited_sockets(port))
    return True


def api_port(argv: list[str]) -> int:
    """The API server's `--port` in its command line (vLLM's default 8000 without one)."""
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return 8000


def drop_inherited_sockets(port: int) -> list[int]:
    """In a forked child: point each file descriptor holding a TCP socket bound to `port` (the API
    server's, bound before the engine starts and listening once it has) at /dev/null; returns the
    descriptors so replaced. Why: a forked engine core otherwise keeps the API server's socket open, so
    when the API process dies alone the port still accepts connections that nobody answers (a
    client waits out its timeout instead of being refused at once) and a restart cannot bind it.
    /dev/null rather than close(): the socket object the child inherited may close its number
    later, which must not be a file opened since."""
    dropped = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            copy = os.dup(fd)
        except OSError:  # the listing's own descriptor, closed since
            continue
        try:
            probe = socket.socket(fileno=copy)
        except OSError:  # not a socket
            os.close(copy)
            continue
        with probe:
            try:
                ours = probe.type == socket.SOCK_STREAM and probe.family in (socket.AF_INET, socket.AF_INET6) \
                    and probe.getsockname()[1] == port
            except OSError:
                ours = False
        if ours:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, fd)
            os.close(null)
            dropped.append(fd)
    return dropped


def main() -> None:
    """Run vLLM's OpenAI server with the arguments in `sys.argv` and leave the process: what
    `python -m lit_rl.inference.vllm_main` does, and what a launcher's server does once forked
    (`lit_rl.inference.launcher`, after `spin_wait_from_environment`)."""
    if os.environ.get(FORK_ENV) and not fork_engine_core():
        logging.getLogger(__name__).warning("%s is set but this vLLM has no CpuPlatform to patch: its engine core "
                                            "starts as vLLM chooses", FORK_ENV)
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


if __name__ == "__main__":
    main()
