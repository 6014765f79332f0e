"""One vLLM launcher per pytest worker (lit_rl/inference/launcher.py), for the `lit-rl` runs the tests
start (tests/forked_cli.py): their servers are forked from a process that has imported vLLM once,
instead of each importing it again (4.0 s instead of 10.0 s a start of the tiny model on 2 cores,
`bench/server_start.py --launcher`).

The servers a test starts itself (VLLMServer in the test's process, the session server) start the
direct way, as a user's do; so do runs of an installed `lit-rl` (tests/test_install.py). The
launcher is started at the first run that asks for it, in the background (its import overlaps the
run's own start-up), and stopped at the end of the session (conftest.py) or with the worker.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from lit_rl.child_process import stop_process_group
from lit_rl.inference.launched_server import start_launcher
from lit_rl.inference.server_env import LAUNCHER_ENV

_started: list[tuple[subprocess.Popen, Path]] = []


def launcher_env() -> dict[str, str]:
    """{LIT_RL_VLLM_LAUNCHER: its socket} for the runs (this worker's launcher, started at the first
    call); {} (every server started directly) when `LIT_RL_TEST_DIRECT_STARTS=1`, to compare or to
    rule the launcher out."""
    return {} if os.environ.get("LIT_RL_TEST_DIRECT_STARTS") == "1" else {LAUNCHER_ENV: launcher_socket()}


@functools.cache
def launcher_socket() -> str:
    """The socket of this worker's launcher, started at the first call."""
    directory = Path(tempfile.mkdtemp(prefix="lit-rl-test-launcher-"))
    _started.append((start_launcher(directory), directory))
    return str(directory / "socket")


def stop_launcher() -> None:
    """Stop the launcher (its servers with it: they die with it) and remove its directory."""
    while _started:
        proc, directory = _started.pop()
        stop_process_group(proc, grace=10)
        shutil.rmtree(directory, ignore_errors=True)
    launcher_socket.cache_clear()
