"""ServerRestarts: the servers a training run started are restarted when they die or hang.

A long run outlives its inference servers (an OOM, a driver fault, a pre-empted node). The run's
`InferenceRuntime` owns one of these; whoever sees a server fail asks it to `recover` that role's
server: a request that failed after the client's own retries (a rollout, the teacher's scoring, a
weight sync) or the watchdog thread, which checks each server every `health_check_interval`
seconds, so that a server that dies while nothing is in flight is found too.

A server needs a restart when its process exited, or its `/health` fails three times in a row
five seconds apart (10 s timeout each). One that hangs is killed at once, so that whoever waits on
it (a weight sync that holds the lock, say) fails now and comes here too. The restart itself is
done once, under the lock that every reload takes as well (a sync and a restart never
interleave): what is left of the process group is stopped, the server is started again with the
same command on the same port (every client keeps its address), then `after_start(role)` (the
runtime reloads the policy's newest synced weights, with their version, so it is unchanged).
Every request that failed because of it is made again: `recover` returns True to a request made
before the restart began (its generation moved on), and to one made while it ran.

At most `max_restarts` per run, all roles together (the evaluator process's restarts too, through
`begin`); a start that fails is one more. Past that `recover` raises `ServerGone`, which ends the
run (its checkpoint written first, `lit_rl.stopping`). A server lit-rl did not start
(a `base_url`) is never restarted: `recover` returns False and the error stands.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from lightning.pytorch.utilities import rank_zero_info

from lit_rl.inference.client import InferenceServerError
from lit_rl.inference.server import ServerStartError, StartInterrupted, VLLMServer, tail

log = logging.getLogger(__name__)


class ServerGone(InferenceServerError):
    """A server lit-rl started is dead or unresponsive and is not restarted again
    (`max_server_restarts` used up, or its restart failed); the run fails."""


class ServerRestarts:
    def __init__(
        self,
        max_restarts: int,
        health_check_interval: float | None,
        *,
        servers: Callable[[], dict[str, VLLMServer | None]],
        after_start: Callable[[str], str],
        interrupted: Callable[[], bool],
    ):
        """
        Args:
            max_restarts: restarts allowed in the run, all roles together.
            health_check_interval: seconds between the watchdog's checks; None or 0: no watchdog.
            servers: the run's servers by role (None for one lit-rl did not start), read each time.
            after_start: called with the role, under the lock, once its server is up again; returns
                what the server serves now, for the log ("the weights of step 12").
            interrupted: True when the run is stopping: no restart is begun, a start gives up.
        """
        self.max_restarts, self.health_check_interval = max_restarts, health_check_interval
        self._servers, self._after_start, self._interrupted = servers, after_start, interrupted
        self.count = 0  # restarts begun in this run
        self.lock = threading.RLock()  # held by every reload and restart of the servers
        self._generations: dict[str, int] = {}  # restarts begun of each role's server
        self._restarting: set[str] = set()  # roles whose server is being restarted now
        self._closing = threading.Event()
        self._watchdog: threading.Thread | None = None

    def generation(self, role: str) -> int:
        """How many restarts of the `role` server have begun: a request made at generation g that
        failed is made again once the generation has moved on (`recover`)."""
        return self._generations.get(role, 0)

    def recover(self, role: str, seen: int, error: BaseException | None = None) -> bool:
        """Called (from any thread) by whoever saw the `role` server fail: a request made at
        generation `seen` that raised `error`, or the watchdog. True: the server was restarted
        since `seen` (or just now), make the request again. False: the error stands (the server is
        alive and answers, it is not lit-rl's, or the run is stopping). Raises `ServerGone` when
        the server is down and no restart is left. The server is examined outside the lock, which
        a weight sync may hold while it waits on this very server."""
        server = self._servers().get(role)
        if server is None or self._interrupted():
            return False
        proc = server.proc
        fault = None if self._restarted_since(role, seen) else self._fault(server, proc)
        if fault is None:
            if not self._restarted_since(role, seen):
                return False
            with self.lock:  # a restart under way: wait until it is done
                return True
        if proc is not None and proc.poll() is None and server.proc is proc and not self._restarted_since(role, seen):
            with contextlib.suppress(ProcessLookupError, PermissionError):  # it hangs: its waiters fail now
                os.killpg(proc.pid, signal.SIGKILL)
        with self.lock:
            if self.generation(role) != seen:
                return True
            if self._interrupted():
                return False
            self._restart(role, server, fault, error)
            return True

    def _restarted_since(self, role: str, seen: int) -> bool:
        return self.generation(role) != seen or role in self._restarting

    def _fault(self, server: VLLMServer, proc: subprocess.Popen | None) -> str | None:
        """Why the server running `proc` needs a restart, or None when it is fine (or was
        replaced, or the run is stopping)."""
        for attempt in range(3):
            if server.proc is not proc:
                return None
            code = proc.poll() if proc is not None else "(stopped)"
            if code is not None:
                return f"exited (code {code})"
            if server.healthy(timeout=10.0):
                return None
            if attempt < 2 and self._closing.wait(5.0):
                return None
        return None if server.proc is not proc else "stopped answering its health check"

    def begin(self, what: str, fault: str, error: BaseException | None, log_path) -> None:
        """Count one restart of `what` ("the policy's vLLM server", "the evaluator") and log it
        with the error that found it and its log's tail; `ServerGone` when none is left."""
        # a TimeoutError of asyncio's (a sync past sync_timeout) has no message: its name, not an IndexError
        said = (str(error).splitlines() or [type(error).__name__])[0] if error is not None else ""
        first = re.sub(r"; last lines of \S+:$", "", said)[:300]
        found = f"; the error that found it: {first}" if first else ""
        if self.count >= self.max_restarts:
            raise ServerGone(f"{what} {fault}, and no restart is left (inference.max_server_restarts="
                             f"{self.max_restarts}, {self.count} used){found}; last lines of {log_path}:\n"
                             f"{tail(log_path, 15)}")
        self.count += 1
        rank_zero_info(f"InferenceRuntime: {what} {fault}{found}; restarting it (restart {self.count} "
                       f"of at most {self.max_restarts}). Last lines of {log_path}:\n{tail(log_path, 10)}")

    def _restart(self, role: str, server: VLLMServer, fault: str, error: BaseException | None) -> None:
        """Restart the `role` server (under the lock). A start that fails (not healthy within its
        `startup_timeout`, or it died while starting) is one more restart, tried again while any
        is left."""
        self.begin(f"the {role}'s vLLM server", fault, error, server.log_path)
        self._generations[role] = self.generation(role) + 1  # a request failing from now on was made to the new one
        self._restarting.add(role)
        try:
            while True:
                started = time.perf_counter()
                try:
                    server.stop()  # whatever is left of its process group
                    if not server.wait_port_free():
                        raise ServerStartError(f"port {server.port} is still in use 30 s after the old server stopped")
                    server.start(self._interrupted)
                    serving = self._after_start(role)
                    break
                except StartInterrupted as e:
                    raise ServerGone(f"the {role}'s vLLM server {fault}, and the run stopped while it restarted") from e
                except (ServerStartError, InferenceServerError) as e:
                    if self._interrupted():
                        raise ServerGone(f"the {role}'s vLLM server {fault}, and restarting it failed: {e}") from e
                    self.begin(f"the {role}'s vLLM server", "failed to start again", e, server.log_path)
        finally:
            self._restarting.discard(role)
        rank_zero_info(f"InferenceRuntime: the {role}'s vLLM server is back, serving {serving} "
                       f"({time.perf_counter() - started:.0f} s)")

    # ---- the watchdog ---------------------------------------------------------------------------
    def start_watchdog(self) -> None:
        """Check the servers every `health_check_interval` s from a thread (when there are any to
        restart and restarts are allowed)."""
        if not (self.health_check_interval and self.max_restarts and any(self._servers().values())):
            return
        self._closing.clear()
        self._watchdog = threading.Thread(target=self._watch, name="lit-rl-server-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """Servers this thread restarts die with it (PR_SET_PDEATHSIG follows the thread that
        started them), so it lives until `close` whatever a restart raised."""
        while not self._closing.wait(self.health_check_interval):
            for role, server in list(self._servers().items()):
                if server is None or self._closing.is_set() or server.healthy(timeout=10.0):
                    continue
                try:
                    self.recover(role, self.generation(role))
                except ServerGone as e:  # out of restarts: the next request fails with it and ends the run
                    log.warning("InferenceRuntime watchdog: %s", str(e).splitlines()[0])
                    self._closing.wait()
                    return
                except Exception as e:  # restarted, but serving its weights again failed (a slow reload):
                    # the next sync or request finds out; the server stays up, and so does the watch
                    log.warning("InferenceRuntime watchdog: after restarting the %s's server: %s", role,
                                str(e).splitlines()[0] if str(e) else type(e).__name__)

    def close(self) -> None:
        """Stop the watchdog; a restart under way gives up (through `interrupted`)."""
        self._closing.set()
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(timeout=60)

    @property
    def closing(self) -> bool:
        return self._closing.is_set()
