"""EvaluatorProcess: the online evaluator of a run (`lit-rl evaluate --follow`), as a process
the run's `InferenceRuntime` starts, restarts and stops.

The evaluator is a process of its own (its vLLM server a child of it) so that evals never slow
a training step. It can die on its own (an OOM, a crash in a custom eval, a kill): the trainer
finds it exited at its next step and starts it again with the same command, counted among the
run's restarts (`inference.max_server_restarts`, `lit_rl.inference.restarts`); once none is
left it is `given_up` and training goes on without evals (an eval never stops training). A
new evaluator loses nothing: what it has evaluated is on disk (`evals/done.jsonl`), retention
keeps every due step it has not (`OnlineEval.needs`), so it goes on with the oldest of those.
Its server was a child that died with it (PR_SET_PDEATHSIG); the new one starts its own.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

from lit_rl.child_process import dies_with_parent, stop_process_group
from lit_rl.inference.server import VLLMServer

EVALUATOR_STOP_GRACE = VLLMServer.STOP_TIMEOUT + 20.0  # seconds between SIGTERM and SIGKILL


class EvaluatorProcess:
    def __init__(self, command: list[str], *, env: dict[str, str], log_path: Path, cpus: list[int] | None = None):
        self.command, self.env, self.log_path, self.cpus = list(command), dict(env), Path(log_path), cpus
        self.proc: subprocess.Popen
        self.given_up = False  # exited with no restart left: not started again
        self.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> None:
        """Start it (again); its output is appended to `log_path`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(dies_with_parent(self.command, self.cpus), stdout=log_file,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def exit_code(self) -> int | None:
        """Its exit code once it has exited, else None."""
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        """Wait up to `timeout` s for it to exit on its own (its last eval done); its exit code,
        or None if it had not."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            rank_zero_info(f"InferenceRuntime: stopping the evaluator (pid {self.proc.pid})")
            # SIGTERM: it stops its own server first, which may take that server's whole grace
            # (SIGKILL after VLLMServer.stop_timeout): the evaluator is given longer, or it would be
            # killed first and a server that hangs on its way out would be left behind
            stop_process_group(self.proc, grace=EVALUATOR_STOP_GRACE)
