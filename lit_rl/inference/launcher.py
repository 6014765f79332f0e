"""A process that has imported vLLM once and forks each vLLM server asked of it: opt-in, for a process
tree that starts many servers (lit-rl's test suite), through `LIT_RL_VLLM_LAUNCHER`.

Why: importing vLLM's API server takes 10-12 s of CPU on a 2-core machine, most of a server's
start; one forked from a process that has imported it already started in 4.0 s instead of 10.0 s
(the tiny model, `bench/server_start.py --launcher`, docs/benchmarks.md). A training run starts
each server once, so it gains little; the suite's `lit-rl` runs start many, each a new process.

    python -m lit_rl.inference.launcher DIR     # listens on DIR/socket (DIR: the caller's, mode 0700)
    LIT_RL_VLLM_LAUNCHER=DIR/socket lit-rl fit ...   # its VLLMServer starts go through the launcher

A request is one JSON line, {"argv", "env", "cwd", "log"}: the arguments of
`python -m lit_rl.inference.vllm_main`, its whole environment, working directory and log file. The
launcher forks; the child becomes what VLLMServer's own start makes: a new session, the environment
and working directory given, stdout and stderr appended to the log, stdin /dev/null, the command line
`ps` and `pgrep -f` show that of `python -m lit_rl.inference.vllm_main ARGV`, SIGTERM when the
launcher dies (PR_SET_PDEATHSIG). The launcher answers {"pid": N}, then {"exit": code} when the
server has ended (Popen's returncode: minus the signal that killed it). The connection ties the
server to the process that asked for it, as PR_SET_PDEATHSIG does on a direct start: when it closes
while the server runs (that process died), the server's group gets SIGTERM, and SIGKILL
`ORPHAN_GRACE_S` later.

What differs from a direct start: the modules were imported under the launcher's environment, so a
variable read only at import (vLLM's logging configuration) has the launcher's value.
"""

from __future__ import annotations

import importlib.util
import json
import os
import selectors
import signal
import socket
import sys
import time

from lit_rl.child_process import exit_with_parent, signal_group

ORPHAN_GRACE_S = 30.0
_REQUEST_TIMEOUT_S = 10.0


def _become_server(request: dict, inherited: list, launcher_pid: int) -> None:
    """In the forked child: set up as VLLMServer's direct start would be, then run vllm_main. Never
    returns: the child must not go back to the launcher's loop."""
    try:
        for resource in inherited:  # the listening socket, every connection, the selector
            resource.close()
        os.setsid()
        exit_with_parent(launcher_pid)
        from setproctitle import setproctitle

        spec = importlib.util.find_spec("lit_rl.inference.vllm_main")
        setproctitle(" ".join([sys.executable, "-m", spec.name, *request["argv"]]))  # before environ changes
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        from lit_rl.inference import vllm_main

        sys.argv = [spec.origin, *request["argv"]]
        sys.path[0] = request["cwd"]  # as `python -m` puts it
        sys.modules["__main__"].__spec__ = spec  # a process vLLM spawns imports vllm_main as __mp_main__
        vllm_main.spin_wait_from_environment()
        vllm_main.main()  # leaves the process
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)  # vllm_main.main() leaves with the server's own code; only a failure gets here


def _read_request(conn: socket.socket) -> dict:
    conn.settimeout(_REQUEST_TIMEOUT_S)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("the request ended before its newline")
        data += chunk
    request = json.loads(data)
    for key, kind in (("argv", list), ("env", dict), ("cwd", str), ("log", str)):
        if not isinstance(request.get(key), kind):
            raise ValueError(f"request field {key!r} must be a {kind.__name__}")
    return request


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the requester is gone; its server is dealt with when the connection is read
        pass


def serve(directory: str) -> None:
    """Import vLLM's server, listen on `directory`/socket, fork a server per request, report exits."""
    import setproctitle
    import vllm.entrypoints.openai.api_server  # noqa: F401  (the import each server then shares)

    import lit_rl.inference.vllm_main  # noqa: F401

    # setproctitle makes room for a title (the environment's memory) on its first call, reading the
    # environment a child then replaces: made here, once, so each child can take its server's title.
    setproctitle.setproctitle(setproctitle.getproctitle())

    path = os.path.join(directory, "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    servers: dict[int, socket.socket] = {}  # pid -> the connection of who asked for it
    orphans: dict[int, float] = {}  # pid -> when its group gets SIGKILL
    print(f"lit-rl vLLM launcher: listening on {path}", flush=True)
    while True:
        for key, _ in selector.select(timeout=0.2):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request = _read_request(conn)
                except (OSError, ValueError) as e:
                    _send(conn, {"error": f"bad request: {e}"})
                    conn.close()
                    continue
                sys.stdout.flush(), sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as e:  # out of memory or processes: this request fails, the others' servers stay
                    _send(conn, {"error": f"fork failed: {e}"})
                    conn.close()
                    continue
                if pid == 0:
                    _become_server(request, [listener, selector, conn, *servers.values()], os.getppid())
                servers[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
                _send(conn, {"pid": pid})
            else:  # a requester's connection: its end (EOF) means the requester is gone
                pid, conn = key.data, key.fileobj
                try:
                    if conn.recv(4096):  # nothing more is expected; ignored
                        continue
                except OSError:
                    pass
                selector.unregister(conn)
                conn.close()
                servers.pop(pid, None)
                signal_group(pid, signal.SIGTERM)
                orphans[pid] = time.monotonic() + ORPHAN_GRACE_S
        while True:  # reap the servers that ended and tell who asked for them
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = servers.pop(pid, None)
            if conn is not None:
                selector.unregister(conn)
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
        for pid, due in list(orphans.items()):  # reaped or not: its engine may be left in the group
            if time.monotonic() > due:
                signal_group(pid, signal.SIGKILL)
                del orphans[pid]


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python -m lit_rl.inference.launcher DIR   (an existing directory, mode 0700)")
    if os.stat(sys.argv[1]).st_mode & 0o077:  # whoever can connect starts servers as this user
        sys.exit(f"lit_rl.inference.launcher: {sys.argv[1]} must be private to its owner (mode 0700)")
    serve(sys.argv[1])
