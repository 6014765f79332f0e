"""Test-only pieces the trainer or evaluator process imports by class path (tests/ on PYTHONPATH)."""

from __future__ import annotations

import asyncio
import os
import signal
import shutil
import time
from pathlib import Path

import lightning as L

from lit_rl.eval.plan import DoneLog, read_final_step
from lit_rl.rollouts.envs import Environment, EvalRun, ReverseTextEnv
from lit_rl.run_dir import STABLE


class DeleteFinalStepAtBase(ReverseTextEnv):
    """At step 0, waits until training has finished and announced its final step, then
    deletes that step's checkpoint before the evaluator gets to it."""

    default_name = "reverse_text"

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        metrics = await super().evaluate(run)
        if run.step == 0:
            root = run.step_dir.parent.parent
            while read_final_step(root) is None:
                await asyncio.sleep(0.2)
            final = root / "weights" / f"step_{read_final_step(root)}"
            assert (final / STABLE).is_file()
            shutil.rmtree(final)
        return metrics


class CrashAtStep(L.Callback):
    """Makes the trainer fail mid-run: at `step`, or at the first step end after the file `when`
    exists (the test writes it once it has seen what it needs while training runs)."""

    def __init__(self, step: int = 3, when: str | None = None):
        self.step, self.when = step, when

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        due = Path(self.when).exists() if self.when else trainer.global_step >= self.step
        if due:
            raise RuntimeError(f"deliberate crash at step {trainer.global_step}")


def hold(until, timeout: float, what: str) -> None:
    """Blocks training (polling every 0.2 s) until `until()` is true; a TimeoutError naming `what`
    after `timeout` s, so a test that went wrong fails instead of hanging."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.2)


class WaitForEval(L.Callback):
    """Holds training at `wait_at` until the evaluator has handled `step`, so a test that wants
    every due step evaluated is not at the mercy of a loaded machine: an evaluator that falls
    behind rightly skips to the newest due step."""

    def __init__(self, step: int, wait_at: int, env: str = "reverse_text", timeout: float = 300):
        self.step, self.wait_at, self.env, self.timeout = step, wait_at, env, timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.wait_at:
            hold(lambda: DoneLog(trainer.default_root_dir).handled(self.step, self.env), self.timeout,
                 f"the evaluator did not handle step {self.step}")


class HoldAtStep(L.Callback):
    """Holds training at the end of `step` until the file `until` exists (the test writes it once
    it has done or seen what it needs): a test about the evaluator then runs on a machine where
    training does not take a core for steps nobody looks at, and no export races its step."""

    def __init__(self, step: int, until: str, timeout: float = 600):
        self.step, self.until, self.timeout = step, until, timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            hold(Path(self.until).exists, self.timeout, f"no {self.until}")


class KillEvaluatorAt(L.Callback):
    """SIGKILLs the run's evaluator process at the end of `step` (an OOM, a kill by hand); its pid
    goes into `<root>/killed_evaluator`. The run's runtime finds it exited at a later step."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        from lit_rl.inference.runtime import InferenceRuntime

        evaluator = InferenceRuntime.of(trainer).evaluator
        os.kill(evaluator.pid, signal.SIGKILL)
        evaluator.wait(timeout=30)
        (Path(trainer.default_root_dir) / "killed_evaluator").write_text(str(evaluator.pid))


def evaluator_processes(root: Path) -> list[int]:
    """pids of evaluator processes working on `root`, and of vLLM servers serving from it."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(root) in cmd and ("lit_rl.cli evaluate" in cmd or "lit_rl.inference.vllm_main" in cmd):
            found.append(p.info["pid"])
    return found


class SlowStopSave(L.Callback):
    """Makes the checkpoint of a graceful stop take ten minutes (its start marked by the file
    `marker`), so a test can press Ctrl-C a second time while it is being written."""

    def __init__(self, marker: str):
        self.marker = marker

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.received_sigterm:
            Path(self.marker).touch()
            time.sleep(600)


class CtrlCTwice(L.Callback):
    """Presses Ctrl-C twice in a row (SIGINT to this process) as step `step` starts: the second
    lands mid-step, before the first could stop the run."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)


class TermDuringValidation(L.Callback):
    """Sends SIGTERM to this process after the first batch of the validation at step `step`, which
    has more batches: Lightning stops that validation there, before its metrics are logged."""

    def __init__(self, step: int):
        self.step = step

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.global_step == self.step and batch_idx == 0 and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)


class NaNLossAtStep(L.Callback):
    """Makes the input embeddings NaN from step `step` on (a forward hook), so that the loss and
    the gradients are: the step must not be applied."""

    def __init__(self, step: int):
        self.step, self._hook = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self._hook is None:
            embeddings = pl_module.model.get_input_embeddings()
            self._hook = embeddings.register_forward_hook(lambda module, args, out: out * float("nan"))


class ScoreFixedIds(Environment):
    """An eval whose metric is the served model's log-probability of fixed token ids: a test
    compares it with the checkpoint's own in transformers, so it shows which weights were served.
    It overrides `evaluate` alone, as docs/evals.md says a custom eval may: no tasks to read."""

    default_name = "score"
    IDS = [5, 17, 60, 101, 33, 2, 250, 9]

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        return {"logprob_sum": sum(await run.client.score(self.IDS))}


class RaisingEval(Environment):
    """A custom eval with a bug: it raises at every step."""

    default_name = "raises"

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        raise ValueError("a bug in this eval")


class HangingEval(Environment):
    """A custom eval that never ends (a reward waiting on a lock that is never released)."""

    default_name = "hangs"

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        await asyncio.Event().wait()
        return {}


class ServedVersion(Environment):
    """A custom eval that returns torch scalars (as a torchmetrics `compute()` does): the version the
    server says it serves while this step is evaluated."""

    default_name = "served"

    async def evaluate(self, run: EvalRun) -> dict:
        import torch

        return {"version": torch.tensor(float(await run.client.served_version())), "half": torch.tensor(0.5)}


def kill_policy_engine(runtime, record: Path, when: int) -> None:
    """SIGKILL the engine processes (the API process's children) of the run's policy server and
    wait until they are gone; `when` (a step, a request number) goes into `record`."""
    import psutil

    engine = psutil.Process(runtime.endpoints["policy"].server.proc.pid).children()
    for process in engine:
        process.kill()
    psutil.wait_procs(engine, timeout=10)
    record.write_text(f"{when} {[p.pid for p in engine]}\n")


class KillPolicyEngineInSync(L.Callback):
    """Hits the reload window exactly: when the weight sync of optimizer step `step` begins its
    reload of the policy's server, a thread SIGKILLs that server's engine processes (its API
    process's children) `delay` seconds later, so that the pause, the reload or the resume is
    the request that finds the server broken. Each kill is recorded in `<root>/killed_in_sync`."""

    def __init__(self, step: int, delay: float = 0.0):
        self.step, self.delay, self.done = step, delay, False

    def on_train_start(self, trainer, pl_module) -> None:
        import threading

        from lit_rl.inference.runtime import InferenceRuntime
        from lit_rl.run_dir import step_of

        runtime = InferenceRuntime.of(trainer)
        load, record = runtime._load, Path(trainer.default_root_dir) / "killed_in_sync"

        def load_and_kill(weights):
            if not self.done and step_of(weights) == self.step:
                self.done = True
                threading.Timer(self.delay, kill_policy_engine, args=(runtime, record, self.step)).start()
            return load(weights)

        runtime._load = load_and_kill


class KillPolicyEngineInRollout(L.Callback):
    """Hits a rollout in flight exactly: just before the `request`-th request of the rollouts goes
    to the policy's server, that server's engine processes are SIGKILLed (and reaped), so that
    this request fails, and with it the rollout that made it: a rollout started, not finished.
    (A request of the tiny model is done in milliseconds: a kill timed after it was sent
    usually came too late.) Recorded in `<root>/killed_in_rollout`."""

    def __init__(self, request: int):
        self.request, self.sent = request, 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        from lit_rl.inference.runtime import InferenceRuntime

        runtime = InferenceRuntime.of(trainer)
        factory, record = runtime.client_factory, Path(trainer.default_root_dir) / "killed_in_rollout"

        def client_factory(role: str, **kwargs):
            make = factory(role, **kwargs)
            if role != "policy":
                return make

            def make_client():
                client = make()
                generate = client.generate

                async def generate_and_kill(*args, **kw):
                    self.sent += 1
                    if self.sent == self.request:
                        kill_policy_engine(runtime, record, self.request)
                    return await generate(*args, **kw)

                client.generate = generate_and_kill
                return client

            return make_client

        runtime.client_factory = client_factory
