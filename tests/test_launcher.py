"""vLLM servers forked by a launcher (lit_rl/inference/launcher.py), as the `lit-rl` runs of the suite
start theirs (tests/vllm_launcher.py): each must be what a direct start gives, and leave as one does."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from vllm_launcher import launcher_socket

from lit_rl.child_process import group_alive
from lit_rl.inference.launched_server import LaunchedServer
from lit_rl.inference.server import IPC_PREFIX, ServerStartError, VLLMServer
from lit_rl.inference.server_env import LAUNCHER_ENV

pytestmark = pytest.mark.slow


def served(model_dir, log_path) -> VLLMServer:
    """The session server's model, as the session server serves it (float32, eager)."""
    return VLLMServer(model_dir, dtype="float32", max_model_len=256, enforce_eager=True, log_path=log_path,
                      allowed_root=model_dir.parent.parent)


async def greedy(server, prompt: list[int]) -> list[int]:
    async with server.client() as client:
        out = await client.generate(prompt, max_tokens=6, temperature=0.0)
    return out[0].completion_ids


def test_a_launched_server_is_set_up_as_a_direct_start_and_its_end_is_reported(vllm_server, tokenizer, monkeypatch, tmp_path):
    """Same tokens as the session server (same weights, greedy); its own session; the command line
    `pgrep -f` finds; its environment (dev mode: a weight reload answers); its log; its exit code."""
    monkeypatch.setenv(LAUNCHER_ENV, launcher_socket())
    log = tmp_path / "vllm.log"
    with served(vllm_server.model_dir, log) as server:
        assert isinstance(server.proc, LaunchedServer)
        pid = server.proc.pid
        assert os.getsid(pid) == os.getpgid(pid) == pid and pid != os.getpid()
        found = subprocess.run(["pgrep", "-f", f"vllm_main --model {vllm_server.model_dir} "], capture_output=True,
                               text=True).stdout.split()
        assert str(pid) in found
        assert os.readlink(f"/proc/{pid}/cwd") == os.getcwd()
        prompt = tokenizer.encode("reverse: launcher")
        assert asyncio.run(greedy(server, prompt)) == asyncio.run(greedy(vllm_server, prompt))

        async def reload():
            async with server.client() as client:
                return await client.reload_weights(vllm_server.model_dir)

        assert asyncio.run(reload()) == 0  # /collective_rpc: VLLM_SERVER_DEV_MODE reached the server
        assert server.proc.poll() is None
        os.killpg(pid, signal.SIGKILL)
        assert server.proc.wait(timeout=10) == -signal.SIGKILL  # as Popen reports a killed process
        assert server.diagnose().startswith("the vLLM server process exited with code -9")
    assert "Application startup complete" in log.read_text()
    deadline = time.monotonic() + 10
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pid)


def test_a_launched_server_dies_with_the_process_that_asked_for_it(vllm_server, tmp_path):
    """The launcher's stand-in for PR_SET_PDEATHSIG: the asker SIGKILLed, its server's group stops."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from test_launcher import served
        from pathlib import Path
        server = served(Path({str(vllm_server.model_dir)!r}), Path({str(tmp_path / "vllm.log")!r})).start()
        print(server.proc.pid, flush=True)
        time.sleep(600)
    """)
    asker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, LAUNCHER_ENV: launcher_socket()})
    try:
        pid = int(asker.stdout.readline())
        assert group_alive(pid)
    finally:
        asker.kill()
        asker.wait()
    deadline = time.monotonic() + 30
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(pid), "the server outlived the process that asked for it"


def test_a_launcher_that_is_not_there_is_a_start_error_naming_the_variable(tmp_path, monkeypatch):
    """At once (no launcher directory: nothing to wait for), and vLLM's socket directory goes too."""
    monkeypatch.setenv(LAUNCHER_ENV, str(tmp_path / "missing" / "socket"))
    ipc_dirs = set(Path(tempfile.gettempdir()).glob(f"{IPC_PREFIX}{os.getpid()}-*"))
    started = time.monotonic()
    with pytest.raises(ServerStartError, match=f"{LAUNCHER_ENV}.*did not answer"):
        VLLMServer(tmp_path, log_path=tmp_path / "vllm.log").start()
    assert time.monotonic() - started < 5
    assert set(Path(tempfile.gettempdir()).glob(f"{IPC_PREFIX}{os.getpid()}-*")) == ipc_dirs
