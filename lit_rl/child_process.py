"""Starting a child process that dies with its parent, optionally kept to some CPU cores.

Used for the vLLM server and the evaluator, which are stopped the same way (`stop_process_group`),
and, through `exit_with_parent`, for the workers of `lit_rl.rewards.math_verify`'s process pool. The child is started through a short Python
launcher that, inside the child and before it execs the real command, asks Linux to
SIGTERM it when the parent dies (PR_SET_PDEATHSIG, which survives exec; it follows the
parent *thread*, so start children from a thread that lives as long as they do), gives up
if the parent is already gone, and pins itself to the given cores (what it execs and
every process that starts inherit them). No `preexec_fn`: it is unsafe in threaded
programs such as a trainer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "if sys.platform.startswith('linux'): ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "os.getppid() == int(sys.argv[1]) or sys.exit(70)\n"
    "if sys.argv[2]: os.sched_setaffinity(0, [int(c) for c in sys.argv[2].split(',')])\n"
    "os.execv(sys.argv[3], sys.argv[3:])"
)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_with_parent(parent_pid: int) -> None:
    """The launcher's first two steps, for a child Python starts itself (a process-pool worker's
    initializer): SIGTERM this process when the thread that started it dies, and exit at once if
    `parent_pid` is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(70)


def dies_with_parent(command: Sequence[str], cpus: Sequence[int] | None = None) -> list[str]:
    """The argv that runs `command` (an absolute executable first) through the launcher."""
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), ",".join(map(str, cpus or ())), *command]


def stop_process_group(proc: subprocess.Popen, grace: float) -> bool:
    """SIGTERM the process group `proc` leads (started with ``start_new_session=True``), SIGKILL
    whatever is left after `grace` seconds, and reap `proc`. True if it stopped within the grace."""
    pgid = proc.pid
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    graceful = False
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, so the group empties
        if not group_alive(pgid):
            graceful = True
            break
        time.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return graceful


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of the group `pgid` is left."""
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
