"""The evaluator: a separate process that evaluates checkpoints while training runs.

It watches `<root>/weights/` for STABLE step directories, reloads its inference server
with each due one, and runs the due evals for that step in turn, so every measurement
belongs to exactly one policy version. When it falls behind each eval skips to its own newest
due step (and it says which it skipped); the base model (step 0) is never skipped, and the
final step always runs every eval. An eval that raises fails alone. A failed reload
(the directory vanished, the server errored) is logged, that step's evals are recorded
as failed, and it goes on. A server it started that died or hangs is restarted
(`ServerRestarts`, at most `--max-server-restarts`) and the step's failed evals run again. It
never touches the trainer: the filesystem is the hand-off (lit_rl/eval/plan.py).

Standalone (`lit-rl evaluate` on a finished run) it evaluates every due eval that has not
succeeded: those in no record, and those that failed or were skipped before (beside training, or
in an earlier standalone run, which a user reruns after fixing what failed), each once; then it
says what failed (`failures`), so that the command can exit 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from lit_rl.child_process import pid_alive
from lit_rl.eval.logging import EvalLogger
from lit_rl.inference.client import InferenceServerError
from lit_rl.eval.plan import DoneLog, EvalPlan, evals_dir, read_final_step
from lit_rl.rollouts.envs import Environment, EvalRun
from lit_rl.rollouts.reward_functions import import_callable
from lit_rl.lora import is_adapter_dir
from lit_rl.run_dir import STABLE, lease, stable_steps

log = logging.getLogger("lit_rl.evaluator")


def instantiate(config: dict) -> Environment:
    """An environment from its `{"class_path", "init_args"}`, as LightningCLI's `instantiate_class`
    makes it, without importing Lightning into the evaluator's process (seconds at every start)."""
    return import_callable(config["class_path"], "evaluator env")(**config.get("init_args", {}))


def metric_values(env: Environment, metrics) -> dict[str, float]:
    """`evaluate`'s dict as floats: a 0-dim tensor (a torchmetrics `compute()`) or numpy number is a
    number; anything else is an error naming the metric. Written as it came, a tensor went into
    eval_metrics.csv as `tensor(0.25)`, which `lit-rl report` could not read."""
    if not isinstance(metrics, dict):
        raise TypeError(f"{type(env).__name__}.evaluate must return a dict of metric name -> number, got {metrics!r}")
    out = {}
    for name, value in metrics.items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{type(env).__name__}.evaluate returned {name!r}: {value!r}, not a number") from e
    return out


class EvalTimeout(TimeoutError):
    """An eval that ran past the plan's `eval_timeout`: recorded as failed, and the evaluator goes on."""


async def within_eval_timeout(evaluation, timeout: float | None):
    """`await evaluation`, cancelled after `timeout` seconds (its requests in flight are aborted). Why: one
    eval that never ends (a reward function waiting on a lock, a tool call that never answers) held the
    evaluator for the rest of the run, so every later step went unevaluated and the trainer's wait for
    the final eval ran out. An eval that blocks the event loop without awaiting cannot be cut short:
    the timeout fires at its next `await`."""
    deadline = asyncio.timeout(timeout)  # None: no limit
    try:
        async with deadline:
            return await evaluation
    except TimeoutError:
        if not deadline.expired():
            raise  # the eval's own, not the limit's
        raise EvalTimeout(f"did not finish in {timeout:g} s (OnlineEval.eval_timeout, lit-rl evaluate "
                          "--eval-timeout)") from None


def newest_of_each(pending: dict[int, list[Environment]]) -> tuple[dict[int, list[Environment]], dict[int, list[Environment]]]:
    """Behind: each environment's newest pending step, and the base model (step 0), which is never
    skipped; the rest is skipped. Per environment: with `intervals`, the newest pending step may
    not be due for all of them, and skipping a slower eval's step for it lost that eval (with an
    evaluator one export behind, every one until the final step). Returns (chosen, skipped)."""
    newest = {}
    for step in sorted(pending):
        for env in pending[step]:
            newest[env.name] = step
    chosen: dict[int, list[Environment]] = {}
    skipped: dict[int, list[Environment]] = {}
    for step in sorted(pending):
        for env in pending[step]:
            (chosen if step == 0 or newest[env.name] == step else skipped).setdefault(step, []).append(env)
    return chosen, skipped


class Evaluator:
    def __init__(
        self,
        root: str | Path,
        plan: EvalPlan,
        client,
        logger: EvalLogger,
        *,
        standalone: bool = False,
        parent_pid: int | None = None,
        poll_seconds: float = 1.0,
        restarts=None,
        envs: list[Environment] | None = None,
    ):
        """
        Args:
            root: the run directory (holds weights/ and evals/).
            plan: what to evaluate and when.
            client: an InferenceClient of a server that may reload from `root`.
            logger: where metrics go.
            standalone: evaluate every stable checkpoint once and exit (a finished run).
            parent_pid: exit when this process (the trainer) is gone.
            restarts: a `lit_rl.inference.restarts.ServerRestarts` of the server (role "evaluator"),
                when this process started it; None: a failed step stays failed.
            envs: the plan's environments, when the caller built them already (`lit-rl evaluate`
                does, before its server starts); None: built here from `plan.envs`.
        """
        self.root, self.plan, self.client, self.logger = Path(root), plan, client, logger
        self.standalone, self.parent_pid, self.poll_seconds = standalone, parent_pid, poll_seconds
        self.restarts = restarts
        self.envs: list[Environment] = envs if envs is not None else [instantiate(cfg) for cfg in plan.envs]
        names = [e.name for e in self.envs]
        if len(set(names)) != len(names):
            raise ValueError(f"evaluator: environment names must be unique, got {names}")
        self.done = DoneLog(root)
        self.attempted: dict[tuple[int, str], str | None] = {}  # (step, env) run here -> its error, None: ok

    # ---- what is due -------------------------------------------------------------------------------
    def final_step(self) -> int | None:
        if self.standalone:
            steps = stable_steps(self.root)
            return max(steps) if steps else None
        return read_final_step(self.root)

    def pending(self, final: int | None) -> dict[int, list[Environment]]:
        """Stable steps with due evals not yet handled."""
        out = {}
        for step in stable_steps(self.root):
            if final is not None and step > final:
                continue
            due = set(self.plan.due(step, [e.name for e in self.envs], final))
            envs = [e for e in self.envs if e.name in due and self.to_do(step, e.name)]
            if envs:
                out[step] = envs
        return out

    def to_do(self, step: int, name: str) -> bool:
        """Not in the done log; standalone, also failed or skipped before, unless tried in this run."""
        status = self.done.entries.get((step, name))
        if self.standalone and status in ("failed", "skipped"):
            return (step, name) not in self.attempted
        return status is None

    def failures(self) -> list[str]:
        """The evals this process ran that did not succeed, one line per environment and error:
        `<env> at steps 0, 10: <error>`."""
        steps: dict[tuple[str, str], list[int]] = {}
        for (step, name), error in sorted(self.attempted.items()):
            if error:
                steps.setdefault((name, error), []).append(step)
        return [f"{name} at step{'s' if len(s) > 1 else ''} {', '.join(map(str, s))}: {error}"
                for (name, error), s in steps.items()]

    def finished(self, final: int | None) -> bool:
        if final is None:
            return False
        return all(self.done.handled(final, n) for n in self.plan.due(final, [e.name for e in self.envs], final))

    # ---- the loop -----------------------------------------------------------------------------------
    def parent_alive(self) -> bool:
        return self.parent_pid is None or pid_alive(self.parent_pid)

    def record_missing_final(self, final: int | None) -> None:
        """The trainer announces its final step only after exporting it: if that directory is
        not there, it vanished (deleted by hand, say) and its evals cannot run."""
        if final is None or self.standalone or final in stable_steps(self.root):
            return
        for name in self.plan.due(final, [e.name for e in self.envs], final):
            if not self.done.handled(final, name):
                log.error("evaluator: the final step %s has no STABLE checkpoint (deleted?); skipping its evals", final)
                self.done.record(final, name, "failed", error="checkpoint directory missing")

    async def run(self) -> None:
        while True:
            final = self.final_step()
            pending = self.pending(final)
            if not pending:
                self.record_missing_final(final)
            if pending:
                chosen, skipped = pending, {}
                if not self.standalone:
                    chosen, skipped = newest_of_each(pending)
                for s, envs in skipped.items():
                    for env in envs:
                        self.done.record(s, env.name, "skipped")
                if skipped:
                    log.warning("evaluator fell behind: skipped %s; evaluating step(s) %s",
                                "; ".join(f"step {s} ({', '.join(e.name for e in envs)})" for s, envs in skipped.items()),
                                ", ".join(map(str, chosen)))
                for step in sorted(chosen):
                    await self.evaluate_step(step, chosen[step])
                continue
            if self.finished(final) or (self.standalone and final is None):
                return
            if not self.parent_alive():
                log.warning("evaluator: the trainer is gone; stopping")
                return
            await asyncio.sleep(self.poll_seconds)

    async def evaluate_step(self, step: int, envs: list[Environment]) -> None:
        """The step's evals; when its server died under them and was restarted, the evals it stopped
        run again, once (a later record of a step's eval replaces the earlier one)."""
        seen = self.restarts.generation("evaluator") if self.restarts is not None else 0
        error, stopped = await self._evaluate_step(step, envs)
        if error is None or self.restarts is None or not isinstance(error, InferenceServerError):
            return
        try:
            restarted = await asyncio.to_thread(self.restarts.recover, "evaluator", seen, error)
        except InferenceServerError as gone:
            log.error("evaluator: %s", gone)
            restarted = False
        if restarted:
            log.warning("evaluator: its server was restarted; evaluating step %s again", step)
            await self._evaluate_step(step, stopped)

    async def _evaluate_step(self, step: int, envs: list[Environment]) -> tuple[Exception | None, list[Environment]]:
        """The step's evals. An eval that raises is recorded as failed and the step's other evals
        still run; a failed reload, or a server error (the server is gone for all of them), stops the
        step: its evals not yet run are recorded as failed. Returns the error that stopped the step
        and the evals it stopped, or (None, [])."""
        step_path = self.root / "weights" / f"step_{step}"
        finished: set[str] = set()
        try:
            with lease(step_path, f"evaluator-{os.getpid()}"):
                if not (step_path / STABLE).is_file():
                    raise FileNotFoundError(f"{step_path} vanished before it could be loaded")
                started = time.perf_counter()
                if is_adapter_dir(step_path):  # a LoRA step: its adapter on the served base, by name
                    version = await self.client.reload_adapter(step_path, f"step_{step}")
                else:
                    version = await self.client.reload_weights(step_path)
                log.info("evaluator: serving step %s (reload %.2f s)", version, time.perf_counter() - started)
                for env in envs:
                    try:
                        await self._evaluate_env(step, step_path, env)
                    except InferenceServerError:
                        raise
                    except Exception as e:  # noqa: BLE001 - this eval's own error: the others still run
                        log.error("evaluator: step %s %s failed (%s: %s)", step, env.name, type(e).__name__, e)
                        self._record_failed(step, env, e)
                    finished.add(env.name)
        except Exception as e:  # noqa: BLE001 - a failed eval must never stop training
            log.error("evaluator: step %s failed (%s: %s); skipping its evals", step, type(e).__name__, e)
            stopped = [env for env in envs if env.name not in finished]
            for env in stopped:
                self._record_failed(step, env, e)
            return e, stopped
        return None, []

    def _record_failed(self, step: int, env: Environment, error: Exception) -> None:
        self.done.record(step, env.name, "failed", error=f"{type(error).__name__}: {error}")
        self.attempted[(step, env.name)] = f"{type(error).__name__}: {error}"

    async def _evaluate_env(self, step: int, step_path: Path, env: Environment) -> None:
        run = EvalRun(step=step, step_dir=step_path, client=self.client, chat_template_kwargs=dict(self.plan.chat_template_kwargs))
        started = time.perf_counter()
        metrics = metric_values(env, await within_eval_timeout(env.evaluate(run), self.plan.eval_timeout))
        out = {f"eval/{env.name}/{k}": v for k, v in metrics.items()}
        out[f"eval/{env.name}/policy_version"] = float(step)
        self.logger.log(step, out)
        if run.traces:
            trace_dir = evals_dir(self.root) / f"step_{step}"
            trace_dir.mkdir(parents=True, exist_ok=True)
            with open(trace_dir / f"{env.name}.jsonl", "w") as f:
                for t in run.traces:
                    f.write(json.dumps(t) + "\n")
        self.done.record(step, env.name, "ok")
        self.attempted[(step, env.name)] = None
        log.info("evaluator: step %s %s %s (%.1f s)", step, env.name, metrics, time.perf_counter() - started)
