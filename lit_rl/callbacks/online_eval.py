"""OnlineEval: evals of real tasks while training runs, without slowing training down.

On rank 0 the run's `InferenceRuntime` starts one evaluator process (`lit-rl evaluate
--follow`) for it, with its own inference server (or a given `base_url`). The trainer's only
part is to make sure a `weights/step_N` exists at every step where some eval is due and at the
last step: it registers with HFExport as a consumer (`export_due`, `needs`), and the evaluator
picks the checkpoints up from the filesystem. At the end of fit the trainer waits (up to
`final_timeout`) for the final eval; on a crash, Ctrl-C or SIGTERM the runtime stops the
evaluator and its server (after a graceful stop's checkpoint).

    trainer:
      callbacks:
        - class_path: lit_rl.callbacks.HFExport
        - class_path: lit_rl.callbacks.OnlineEval
          init_args:
            interval: 100
            envs:
              - class_path: lit_rl.rollouts.ReverseTextEnv
                init_args: {num_examples: 100}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_rl.callbacks.export import HFExport
from lit_rl.data.render import chat_template_kwargs_problem
from lit_rl.eval.plan import DoneLog, EvalPlan, clear_final_step, evals_dir, write_final_step
from lit_rl.eval.wandb_shared import describe_run, make_trainer_primary
from lit_rl.inference.runtime import InferenceRuntime
from lit_rl.rollouts.envs import Environment
from lit_rl.run_dir import step_of
from lit_rl.server_options import evaluator_server_problems, typed_server_options


def check_cpus(cpus: list[int] | None) -> list[int] | None:
    if cpus is None:
        return None
    allowed = set(range(os.cpu_count() or 1))  # not this process's affinity: training may be pinned elsewhere
    if not cpus or not set(cpus) <= allowed:
        raise ValueError(f"OnlineEval.cpus must be a non-empty list of this machine's cores {sorted(allowed)}, got {cpus}")
    return sorted(set(cpus))


def pinned_environment(cpus: list[int]) -> dict[str, str]:
    """Threads of the evaluator's torch and of vLLM's CPU engine stay on the given cores."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "OMP_NUM_THREADS": str(len(cpus))}


class OnlineEval(L.Callback):
    def __init__(
        self,
        envs: list[Environment],
        interval: int = 100,
        intervals: dict[str, int] | None = None,
        eval_base: bool = True,
        base_url: str | None = None,
        api_key: str | None = None,
        server: dict | None = None,
        final_timeout: float = 900.0,
        eval_timeout: float | None = 1800.0,
        cpus: list[int] | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        """
        Args:
            envs: eval environments (tasks + reward), e.g. ``lit_rl.rollouts.ReverseTextEnv``.
            interval: evaluate every N optimizer steps (and always at the last step).
            intervals: per-environment intervals by name, overriding ``interval``.
            eval_base: evaluate the model before training (step 0).
            base_url: an existing vLLM server (started with ``VLLM_SERVER_DEV_MODE=1``) that can
                read this run directory; None starts one for the evaluator.
            api_key: the server's API key.
            server: options for the server lit-rl starts (``lit_rl.inference.server.VLLMServer``),
                e.g. ``{max_model_len: 1024, dtype: float32}``.
            final_timeout: seconds the trainer waits at the end for the final eval.
            eval_timeout: seconds one environment's eval of one step may take; past it the eval is
                recorded as failed (`lit-rl evaluate` on the run reruns it) and the evaluator goes on
                with the next. None: no limit, and an eval that never ends stops every eval after it.
            cpus: CPU cores for the evaluator and the vLLM CPU server it starts, e.g. the cores
                training leaves free (pin training with ``taskset``). None: no pinning, so on a
                CPU machine both compete for the same cores.
            chat_template_kwargs: the chat template's variables eval prompts are rendered with (e.g.
                ``{enable_thinking: false}``); None: the training data's (``data.init_args.chat_template_kwargs``),
                so a model is evaluated on prompts rendered as it was trained on them.
        """
        if interval < 1 or any(v < 1 for v in (intervals or {}).values()):
            raise ValueError(f"OnlineEval: intervals must be >= 1, got interval={interval}, intervals={intervals}")
        names = [e.name for e in envs]
        if not envs or len(set(names)) != len(names):
            raise ValueError(f"OnlineEval: give at least one environment, with unique names; got {names}")
        unknown = set(intervals or {}) - set(names)
        if unknown:
            raise ValueError(f"OnlineEval.intervals names unknown environments {sorted(unknown)}; known: {names}")
        if eval_timeout is not None and not eval_timeout > 0:
            raise ValueError(f"OnlineEval.eval_timeout must be > 0 seconds, or null for no limit; got {eval_timeout}")
        if base_url and server:
            raise ValueError("OnlineEval: give base_url (an existing server) or server options, not both")
        problems = evaluator_server_problems(server or {}, envs, where="server.")
        if problem := chat_template_kwargs_problem(chat_template_kwargs):
            problems.append(problem)
        # their rows read now: a missing file or column said before training, not at every eval
        problems += [f"environment {env.name!r}: {problem}" for env in envs if (problem := env.tasks_problem())]
        if problems:
            raise ValueError("OnlineEval: " + "; ".join(problems))
        self.plan = EvalPlan(envs=[e.to_config() for e in envs], interval=interval, intervals=dict(intervals or {}),
                             eval_base=eval_base, eval_timeout=eval_timeout)
        self.names = names
        self.base_url, self.api_key, self.server = base_url, api_key, typed_server_options(server or {})
        self.final_timeout = final_timeout
        self.cpus = check_cpus(cpus)
        self.chat_template_kwargs = chat_template_kwargs
        self.export: HFExport | None = None
        self.runtime: InferenceRuntime | None = None

    # ---- what is due ----------------------------------------------------------------------------------
    def due(self, step: int, final: int | None = None) -> bool:
        return bool(self.plan.due(step, self.names, final))

    # ---- what HFExport asks its consumers ---------------------------------------------------------------
    def export_due(self, step: int) -> bool:
        return self.due(step)

    def needs(self, path: Path) -> bool:
        """A due step the evaluator has not handled yet is needed: retention must spare it."""
        step = step_of(path)
        if step is None or path.parent.name != "weights" or not self.due(step):
            return False
        done = DoneLog(path.parent.parent)  # <root>/weights/step_N
        return not all(done.handled(step, n) for n in self.plan.due(step, self.names, None))

    # ---- start ----------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self.runtime = InferenceRuntime.of(trainer)  # it runs the evaluator, and starts it again if it exits
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and trainer.is_global_zero:
                make_trainer_primary(logger)  # before the run starts: the evaluator will write into it

    def on_train_start(self, trainer, pl_module) -> None:
        exports = [c for c in trainer.callbacks if isinstance(c, HFExport)]
        if not exports:
            raise ValueError("OnlineEval needs an HFExport callback in trainer.callbacks (it writes the checkpoints evaluated)")
        self.export = exports[0]
        root = Path(trainer.default_root_dir)
        self.export.prepare_run(trainer)  # evals/ too: a fresh run's holds none of an earlier run's (forget_evals)
        self.export.register(self)
        if trainer.is_global_zero:
            clear_final_step(root)
            self.plan.chat_template_kwargs = dict(self.chat_template_kwargs if self.chat_template_kwargs is not None
                                                  else getattr(trainer.datamodule, "chat_template_kwargs", None) or {})
            self.plan.save(root)
        trainer.strategy.barrier("online_eval_plan")
        if trainer.global_step == 0 and self.plan.eval_base:
            self.export.ensure(trainer, pl_module, 0)  # the base model, as the evaluator will serve it
        if trainer.is_global_zero:
            self._start_evaluator(trainer, root)

    def _logger_args(self, trainer) -> list[str]:
        args = []
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                args += ["--log-dir", logger.log_dir]
            elif isinstance(logger, WandbLogger):
                args += ["--wandb", json.dumps(describe_run(logger.experiment))]
        return args

    def _start_evaluator(self, trainer, root: Path) -> None:
        cmd = [sys.executable, "-m", "lit_rl.cli", "evaluate", "--run-dir", str(root), "--follow",
               "--parent-pid", str(os.getpid()), *self._logger_args(trainer)]
        if self.base_url:
            cmd += ["--base-url", self.base_url]
        else:
            cmd += ["--server", json.dumps(self.server),
                    "--max-server-restarts", str(self.runtime.max_server_restarts)]
        env = dict(os.environ)
        env.pop("WANDB_SERVICE", None)  # the trainer's W&B service refuses a second writer of its run id
        if self.cpus:
            env.update(pinned_environment(self.cpus))
        if self.api_key:
            env["LIT_RL_EVAL_API_KEY"] = self.api_key
            cmd += ["--api-key-env", "LIT_RL_EVAL_API_KEY"]
        log_path = evals_dir(root) / "evaluator.log"
        proc = self.runtime.start_evaluator(cmd, env=env, log_path=log_path, cpus=self.cpus)
        rank_zero_info(f"OnlineEval: evaluator started (pid {proc.pid}), log: {log_path}")

    # ---- after training -----------------------------------------------------------------------------------
    def on_train_end(self, trainer, pl_module) -> None:
        step = trainer.global_step
        self.export.ensure(trainer, pl_module, step)  # the final step, whatever the callback order
        if not trainer.is_global_zero or self.runtime.evaluator is None:
            return
        write_final_step(trainer.default_root_dir, step)
        rank_zero_info(f"OnlineEval: waiting up to {self.final_timeout:.0f} s for the evaluator's final eval (step {step})")
        code = self.runtime.finish_evaluator(self.final_timeout)
        if code is None:
            rank_zero_warn(f"OnlineEval: the final eval did not finish in {self.final_timeout:.0f} s; stopped the evaluator")
        elif code != 0:
            rank_zero_warn(f"OnlineEval: the evaluator exited with code {code}; see {evals_dir(trainer.default_root_dir)}/evaluator.log")
        self._warn_of_failed_evals(Path(trainer.default_root_dir))

    def _warn_of_failed_evals(self, root: Path) -> None:
        """The evals that failed during the run, said in the trainer's output at its end (each was
        logged only in evaluator.log as it failed); `lit-rl evaluate --run-dir` runs them again."""
        failed = [(step, name) for (step, name), status in sorted(DoneLog(root).entries.items()) if status == "failed"]
        if failed:
            shown = ", ".join(f"{name} at step {step}" for step, name in failed[:5]) + (" ..." if len(failed) > 5 else "")
            rank_zero_warn(f"OnlineEval: {len(failed)} eval(s) failed ({shown}); the errors are in "
                           f"{evals_dir(root)}/done.jsonl and evaluator.log; `lit-rl evaluate --run-dir {root}` "
                           "runs them again")
