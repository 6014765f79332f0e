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
