"""ServerRestarts on real processes that fail at once (the suite's end-to-end restarts of real
vLLM servers are in test_faults.py, test_graceful_stop.py and test_online_eval.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lit_rl.inference.restarts import ServerGone, ServerRestarts
from lit_rl.inference.server import VLLMServer, free_port


class ExitsWhileStarting(VLLMServer):
    """A server whose process exits with code 7 during every start-up (a crash at load time)."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "print('loading'); raise SystemExit(7)"]


def test_a_restart_whose_start_fails_is_tried_again_as_another_restart_until_none_is_left(tmp_path, caplog):
    server = ExitsWhileStarting("tiny", port=free_port("127.0.0.1"), log_path=tmp_path / "vllm.log")
    server.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(0)"])  # the server that died
    server.proc.wait()
    started_again = []
    restarts = ServerRestarts(2, None, servers=lambda: {"policy": server},
                              after_start=lambda role: started_again.append(role) or "its model", interrupted=lambda: False)
    with caplog.at_level("INFO"), pytest.raises(ServerGone) as gone:
        restarts.recover("policy", 0, RuntimeError("generate: the inference server is unreachable"))
    assert restarts.count == 2 and restarts.generation("policy") == 1 and not started_again
    log = caplog.text
    assert "the policy's vLLM server exited (code 0); the error that found it: generate: the inference server is " \
           "unreachable; restarting it (restart 1 of at most 2)" in log, log
    assert "the policy's vLLM server failed to start again; the error that found it: vLLM server for tiny exited " \
           "with code 7 during start-up.; restarting it (restart 2 of at most 2)" in log, log
    message = str(gone.value)
    assert message.startswith("the policy's vLLM server failed to start again, and no restart is left "
                              "(inference.max_server_restarts=2, 2 used)"), message
    assert (tmp_path / "vllm.log").read_text().count("loading") == 2  # two starts, both logged
    assert server.proc is None  # the last failed start was stopped


def test_the_weights_the_policy_server_serves_stay_on_disk_until_newer_ones_are_loaded(tmp_path):
    """With keep_sync 1 the sync of step 2 deleted sync/step_1 while the server still served it;
    a restart before step 2's reload loaded step_1 again, found it gone and failed the run. The
    runtime is a consumer of the run's HFExport: retention spares what its server serves."""
    import lightning as L

    from lit_rl.callbacks.export import HFExport
    from lit_rl.inference.runtime import InferenceRuntime
    from lit_rl.run_dir import STABLE, sync_dir

    exporter = HFExport(keep_sync=1)
    trainer = L.Trainer(accelerator="cpu", logger=False, callbacks=[exporter], default_root_dir=tmp_path)
    runtime = InferenceRuntime()
    assert runtime._run_exporter(trainer) is exporter

    def synced(step):
        path = sync_dir(tmp_path) / f"step_{step}"
        path.mkdir(parents=True)
        (path / STABLE).touch()
        return path

    one = synced(1)
    runtime._served = one  # the server serves step 1
    exporter._retain_syncs(tmp_path, synced(2))  # step 2 written, not loaded yet
    assert sorted(p.name for p in sync_dir(tmp_path).iterdir()) == ["step_1", "step_2"]
    runtime._served = sync_dir(tmp_path) / "step_2"  # loaded: step 1 may go
    exporter._retain_syncs(tmp_path, synced(3))
    assert sorted(p.name for p in sync_dir(tmp_path).iterdir()) == ["step_2", "step_3"]


class AnswersHealth(VLLMServer):
    """A stand-in server process that answers /health and /v1/models: python's http.server over
    a directory holding those files (its model)."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1", "--directory", str(self.model)]


def test_the_watchdog_keeps_a_server_it_restarted_alive_when_serving_its_weights_again_fails(tmp_path):
    """A server started from the watchdog's thread dies with that thread (PR_SET_PDEATHSIG). The
    watchdog returned when a restart raised (a reload slower than sync_timeout), which killed the
    server it had just restarted and left the run without a watch."""
    import os
    import signal
    import time

    (tmp_path / "health").write_text("ok")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text('{"data": []}')
    server = AnswersHealth(str(tmp_path), port=free_port("127.0.0.1"), log_path=tmp_path / "server.log", startup_timeout=60)
    failed = []

    def serve_again(role):
        failed.append(role)
        raise TimeoutError("the reload took longer than sync_timeout")

    restarts = ServerRestarts(2, 0.2, servers=lambda: {"policy": server}, after_start=serve_again, interrupted=lambda: False)
    with server:
        restarts.start_watchdog()
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)  # the server dies; the watchdog restarts it
            deadline = time.monotonic() + 60
            while not failed and time.monotonic() < deadline:
                time.sleep(0.1)
            assert failed == ["policy"] and restarts.count == 1
            time.sleep(2.0)  # a death signal would have arrived by now
            assert server.proc.poll() is None and server.healthy()
            assert restarts._watchdog.is_alive()
        finally:
            restarts.close()


def test_a_restart_found_by_an_error_without_a_message_names_its_type(tmp_path, caplog):
    """A weight sync past `sync_timeout` hands `recover` asyncio's TimeoutError, whose message is
    empty: counting the restart raised IndexError ("list index out of range"), the server already
    killed and not restarted, and the run ended on that."""
    import asyncio

    async def too_slow():
        await asyncio.wait_for(asyncio.sleep(10), 0.01)

    with pytest.raises(TimeoutError) as timeout:
        asyncio.run(too_slow())
    assert str(timeout.value) == ""
    restarts = ServerRestarts(1, None, servers=lambda: {}, after_start=lambda role: "", interrupted=lambda: False)
    with caplog.at_level("INFO"):
        restarts.begin("the policy's vLLM server", "stopped answering its health check", timeout.value, tmp_path / "vllm.log")
    assert restarts.count == 1 and "the error that found it: TimeoutError; restarting it (restart 1 of at most 1)" in caplog.text


def test_a_pause_that_fails_is_followed_by_a_resume(tmp_path):
    """A weight sync whose `/pause` fails without being cancelled (here answered 501; in a run a 5xx,
    or a reset connection after it landed): `/resume` was sent only after a cancelled `/pause`, so a
    server that had paused stayed paused, every later request hanging. Now `/resume` follows any
    `/pause` that was sent."""
    import asyncio

    from lit_rl.inference.client import InferenceClient, InferenceServerError
    from lit_rl.run_dir import STABLE

    (tmp_path / "health").write_text("ok")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text('{"data": []}')
    step = tmp_path / "run" / "weights" / "step_1"
    step.mkdir(parents=True)
    (step / STABLE).write_text("")
    server = AnswersHealth(str(tmp_path), port=free_port("127.0.0.1"), log_path=tmp_path / "server.log", startup_timeout=60)

    async def sync() -> None:
        async with InferenceClient(server.base_url, model="m", allowed_root=tmp_path / "run", max_retries=0) as client:
            await client.reload_weights(step)

    with server:
        with pytest.raises(InferenceServerError):
            asyncio.run(sync())
    requests = [line for line in (tmp_path / "server.log").read_text().splitlines() if '"POST /' in line]
    assert any('"POST /pause' in line for line in requests), requests
    assert '"POST /resume' in requests[-1], requests
