"""The requester's side of a vLLM launcher (`lit_rl.inference.launcher`, whose docstring says what it
is for): a server the launcher forked, handled as VLLMServer handles the process it starts itself.

Apart from launcher.py because that module is run with `python -m`: imported by the package first
(server.py), Python would run it a second time as `__main__` and warn so (runpy's RuntimeWarning).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from lit_rl.child_process import dies_with_parent, pid_alive
from lit_rl.inference.server_env import LAUNCHER_ENV

_REQUEST_TIMEOUT_S = 10.0
_STARTING_LAUNCHER_WAIT_S = 120.0


class LauncherError(RuntimeError):
    """The launcher could not be reached, or could not start the server (its reason given)."""


def start_launcher(directory: Path) -> subprocess.Popen:
    """Start `python -m lit_rl.inference.launcher directory` (a directory private to its owner), its
    output in directory/launcher.log, dying with this process; its socket, directory/socket, is
    bound once it has imported vLLM (a LaunchedServer waits for it)."""
    with open(directory / "launcher.log", "wb") as log:
        return subprocess.Popen(dies_with_parent([sys.executable, "-m", "lit_rl.inference.launcher", str(directory)]),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


class LaunchedServer:
    """A server started by a launcher, with the part of subprocess.Popen's interface that VLLMServer
    and `stop_process_group` use: `pid`, `poll()`, `wait(timeout)`, `returncode`."""

    def __init__(self, socket_path: str, argv: list[str], env: dict[str, str], cwd: str, log: str):
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._buffer = b""
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._connect(socket_path)
            request = {"argv": list(argv), "env": dict(env), "cwd": cwd, "log": log}
            self._conn.sendall(json.dumps(request).encode() + b"\n")
            reply = self._message(_REQUEST_TIMEOUT_S)
        except (OSError, ValueError, EOFError) as e:
            self._conn.close()
            raise LauncherError(f"the vLLM launcher at {socket_path} ({LAUNCHER_ENV}) did not answer: {e}") from e
        if not reply or "pid" not in reply:
            self._conn.close()
            reason = reply.get("error") if reply else "it closed the connection"
            raise LauncherError(f"the vLLM launcher at {socket_path} ({LAUNCHER_ENV}) started no server: {reason}")
        self.pid: int = reply["pid"]

    def _connect(self, socket_path: str) -> None:
        """Connect, waiting out a launcher that is still importing vLLM (its directory there, its socket
        not yet bound)."""
        deadline = time.monotonic() + _STARTING_LAUNCHER_WAIT_S
        while True:
            try:
                return self._conn.connect(socket_path)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline or not os.path.isdir(os.path.dirname(socket_path)):
                    raise
                time.sleep(0.2)

    def _message(self, timeout: float | None) -> dict | None:
        """The launcher's next message; None if none came within `timeout`. Raises EOFError when the
        launcher has closed the connection."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with self._lock:  # one reader of the connection at a time, for 0.2 s at most
                if self.returncode is None:
                    self._read_exit(0.2 if left is None else min(left, 0.2))
            if self.returncode is not None:
                return self.returncode
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["vllm_main"], timeout)

    def _read_exit(self, timeout: float) -> None:
        try:
            message = self._message(timeout)
        except (EOFError, OSError):  # the launcher died: PR_SET_PDEATHSIG has SIGTERMed the server
            message = None if pid_alive(self.pid) else {"exit": -signal.SIGTERM}
            if message is None:
                time.sleep(timeout)
        if message is not None and "exit" in message:
            self.returncode = message["exit"]
            self._conn.close()

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0.0)
        except subprocess.TimeoutExpired:
            return None
