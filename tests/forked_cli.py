"""`python -m lit_rl.cli ARGS` in a process of its own, forked from one that has already imported
lit-rl, Lightning, torch and transformers.

Why: a fresh interpreter spends 6-9 s of CPU importing them before a test's run does 2-3 s of work,
and the suite starts dozens of such runs on two cores. multiprocessing's forkserver imports them
once per pytest worker; each run is then a fork of it (measured on a 3-step SFT run: 11.6 s as a
subprocess, 2.9 s forked).

What a run sees is what `python -m lit_rl.cli` gives it: its own pid (a signal reaches it alone,
or its session with `new_session`), the environment, working directory and `sys.argv` given,
`sys.path` as a fresh interpreter in that directory would build it (PYTHONPATH included, the test
directories pytest adds left out), `__main__` carrying lit_rl.cli's spec (so Lightning's launcher
starts DDP's other ranks as `python -m lit_rl.cli ...`), uncaught exceptions printed with exit code
1, atexit hooks run at the end, stdout and stderr captured. What differs: modules were imported
under the pytest worker's environment, so a variable read only at import time (none of lit-rl's)
keeps the worker's value; the process's command line in /proc is the forkserver's; the vLLM servers
it starts are forked by the worker's launcher (tests/vllm_launcher.py), not started as new interpreters.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from vllm_launcher import launcher_env

PRELOAD = [
    "lit_rl.cli", "lit_rl.lightning_cli", "lit_rl.modules", "lit_rl.data", "lit_rl.data.rollout_datamodule",
    "lit_rl.callbacks", "lit_rl.callbacks.online_eval", "lit_rl.rollouts", "lit_rl.inference.runtime", "lit_rl.eval",
]


@functools.cache
def _context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


@functools.cache
def _interpreter_path() -> tuple[str, ...]:
    """sys.path of a fresh interpreter, less its first entry (the working directory under -m)."""
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                         capture_output=True, text=True, check=True)
    return tuple(json.loads(out.stdout))


def _cli_main(args, env, cwd, out_path, err_path, new_session, interpreter_path):
    """The forked process: set up as `python -m lit_rl.cli` would be, run, exit with its code."""
    if new_session:
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *interpreter_path]
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    spec = importlib.util.find_spec("lit_rl.cli")
    sys.argv = [spec.origin, *args]
    sys.modules["__main__"].__spec__ = spec
    from lit_rl import cli

    code, interrupted = 0, False
    try:
        cli.main()
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:  # as the interpreter does with sys.exit("message")
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    if interrupted:  # the interpreter's exit on an uncaught Ctrl-C: killed by SIGINT
        sys.stdout.flush(), sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(code)


#: the output files of the runs this process started that nobody has read yet (a test that failed
#: while its run was going leaves them): `remove_leftover_outputs` at the end of the session
_UNREAD: set[str] = set()


def remove_leftover_outputs() -> None:
    """Remove the output files of runs whose output was never read (conftest's session end)."""
    for path in list(_UNREAD):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        _UNREAD.discard(path)


class ForkedCLI:
    """A running `lit-rl` with the part of subprocess.Popen's interface the tests use (text mode)."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: str, new_session: bool = False):
        self.args = list(args)
        self._paths = []
        for suffix in (".out", ".err"):
            fd, path = tempfile.mkstemp(prefix="lit-rl-test-", suffix=suffix)
            os.close(fd)
            self._paths.append(path)
            _UNREAD.add(path)
        env = {**launcher_env(), **env}  # its vLLM servers forked by this worker's launcher (vllm_launcher.py)
        self._process = _context().Process(
            target=_cli_main, args=(self.args, env, str(cwd), *self._paths, new_session,
                                    _interpreter_path()))
        try:
            self._process.start()
        except BaseException:
            for path in self._paths:
                os.unlink(path)
                _UNREAD.discard(path)
            raise
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the process has ended (its output then read, its files removed)."""
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self._output = []
            for path in self._paths:
                with open(path) as read:
                    self._output.append(read.read())
                os.unlink(path)
                _UNREAD.discard(path)
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(["lit-rl", *self.args], timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._output[0], self._output[1]

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def run_forked(args: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True, timeout=...) for `lit-rl ARGS`, forked."""
    proc = ForkedCLI(args, env, cwd)
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise subprocess.TimeoutExpired(["lit-rl", *args], time.monotonic() - started)
    return subprocess.CompletedProcess(["lit-rl", *args], proc.returncode, out, err)
