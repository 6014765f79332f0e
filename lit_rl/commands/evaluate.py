"""`lit-rl evaluate`: the evaluator process.

    # every stable checkpoint of a finished run, on a server you run
    lit-rl evaluate --weights-dir runs/x/weights --base-url http://127.0.0.1:8000/v1
    # the same with lit-rl starting a vLLM server (on the first checkpoint it evaluates)
    lit-rl evaluate --weights-dir runs/x/weights --env lit_rl.rollouts.ReverseTextEnv

The OnlineEval callback starts this command itself during training (`--follow`): it then
keeps watching `weights/` until the trainer's final step is evaluated or the trainer is
gone. LoRA checkpoints (an adapter in each step directory) are served on their base model, with
each step's adapter loaded by name (`step_N`). Which environments to run comes from `--plan` (default `<run dir>/evals/plan.json`,
written by OnlineEval) or from `--env CLASS_PATH` (repeatable; `--env-args` takes JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from lit_rl.child_process import pid_alive
from lit_rl.data.render import chat_template_kwargs_problem
from lit_rl.errors import UserError
from lit_rl.eval.evaluator import Evaluator, instantiate
from lit_rl.eval.logging import EvalLogger
from lit_rl.eval.plan import EvalPlan, evals_dir
from lit_rl.lora import adapter_base, is_adapter_dir, lora_server_options
from lit_rl.run_dir import lease, stable_steps
from lit_rl.server_options import evaluator_server_problems


def json_object(text: str) -> dict:
    """The type of the JSON options (--server, --env-args, --wandb): a bad one is named by argparse
    (`argument --server: not JSON ...`, exit 2) instead of a JSONDecodeError's traceback."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"give a JSON object, got {text}")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lit-rl evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--weights-dir", help="a run's weights/ directory")
    where.add_argument("--run-dir", help="a run directory (holds weights/)")
    p.add_argument("--base-url", help="an existing OpenAI-compatible vLLM server (started with VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--api-key-env", default=None, help="name of the environment variable holding the server's API key")
    p.add_argument("--server", type=json_object, default="{}", help="JSON of VLLMServer options when lit-rl starts the server")
    p.add_argument("--plan", help="plan.json (default: <run dir>/evals/plan.json)")
    p.add_argument("--env", action="append", default=[], help="environment class path (repeatable)")
    p.add_argument("--env-args", type=json_object, action="append", default=[], help="JSON init args of the --env at the same position")
    p.add_argument("--chat-template-kwargs", type=json_object, default=None,
                   help="JSON of the chat template's variables for eval prompts, e.g. '{\"enable_thinking\": false}' "
                        "(default: the plan's, which OnlineEval takes from the training data; with --env: none)")
    p.add_argument("--log-dir", help="where eval_metrics.csv goes (default: <run dir>/evals)")
    p.add_argument("--wandb", type=json_object, default=None, help="JSON of wandb.init arguments to join the trainer's run")
    p.add_argument("--eval-timeout", type=float, default=None,
                   help="seconds one environment's eval of one step may take before it is recorded as failed "
                        "(default: the plan's, 1800 unless OnlineEval.eval_timeout set it; with --env: 1800)")
    p.add_argument("--follow", action="store_true", help="keep watching until the trainer's final step is evaluated")
    p.add_argument("--parent-pid", type=int, default=None, help="stop when this process is gone")
    p.add_argument("--start-timeout", type=float, default=3600.0,
                   help="with --follow: seconds to wait for the first checkpoint (without it, none waits; with "
                        "--parent-pid, as long as that process lives)")
    p.add_argument("--max-server-restarts", type=int, default=3,
                   help="restarts of the server it started, when that dies or hangs (the step is evaluated again)")
    args = p.parse_args(argv)
    if problems := option_problems(args):
        p.error("; ".join(problems))
    return args


def option_problems(args: argparse.Namespace) -> list[str]:
    """Options that would be ignored without a word (an environment never evaluated, server options
    never used), said together as one usage error (exit 2)."""
    problems = []
    if len(args.env_args) > len(args.env):
        problems.append(f"{len(args.env_args)} --env-args for {len(args.env)} --env: each --env-args "
                        "goes with the --env at the same position")
    if args.plan and args.env:
        problems.append("--plan and --env: give one (--env makes its own plan)")
    if args.base_url and args.server:
        problems.append("--server: options of a server lit-rl starts, but --base-url names one already running")
    if args.eval_timeout is not None and not args.eval_timeout > 0:
        problems.append(f"--eval-timeout must be > 0 seconds, got {args.eval_timeout}")
    if args.max_server_restarts < 0:
        problems.append(f"--max-server-restarts must be >= 0, got {args.max_server_restarts}")
    return problems


def run_root(args: argparse.Namespace) -> Path:
    """The run directory: `--run-dir`, or the parent of `--weights-dir`, which must be a run's
    `weights/` (checkpoints are read from `<run dir>/weights/step_N`, whatever was named). Either
    must exist, unless `--follow` waits for it."""
    given = args.run_dir or args.weights_dir
    if not args.follow and not Path(given).is_dir():  # --follow may wait for a run that has not written it yet
        raise UserError(f"--{'run' if args.run_dir else 'weights'}-dir {given}: no such directory")
    if args.run_dir:
        return Path(args.run_dir)
    weights = Path(args.weights_dir)
    if weights.resolve().name != "weights":
        raise UserError(f"--weights-dir {args.weights_dir}: not a run's weights/ directory (lit-rl reads "
                        "<run dir>/weights/step_N); give that directory, or --run-dir with the run directory")
    return weights.resolve().parent


def load_plan(args: argparse.Namespace, root: Path) -> EvalPlan:
    if args.env:
        extra = args.env_args + [{}] * (len(args.env) - len(args.env_args))
        plan = EvalPlan(envs=[{"class_path": c, "init_args": a} for c, a in zip(args.env, extra)], interval=1)
    else:
        path = Path(args.plan) if args.plan else evals_dir(root) / "plan.json"
        if not path.is_file():
            raise SystemExit(f"lit-rl evaluate: no plan at {path}; give --plan or --env CLASS_PATH")
        try:
            plan = EvalPlan.load(path)
        except (ValueError, TypeError) as e:  # not JSON, or not a plan's fields
            raise UserError(f"{'--plan ' if args.plan else ''}{path}: not an eval plan ({type(e).__name__}: {e})") from e
    if args.chat_template_kwargs is not None:
        if problem := chat_template_kwargs_problem(args.chat_template_kwargs):
            raise UserError(f"--chat-template-kwargs: {problem}")
        plan.chat_template_kwargs = args.chat_template_kwargs
    if args.eval_timeout is not None:
        plan.eval_timeout = args.eval_timeout
    return plan


def first_checkpoint(root: Path, timeout: float | None, parent_pid: int | None) -> Path:
    """The evaluator's server starts on a real checkpoint of this run (step 0 when it exists).

    `timeout` None: the run is finished (no --follow), so an empty weights/ is an error now, not
    an hour's silent wait for checkpoints nobody is writing. With `parent_pid` (OnlineEval's
    evaluator) the wait lasts while the trainer lives: without `eval_base` its first checkpoint
    comes at the first eval interval, which may be hours away, and an exit there would be counted
    as a crash and restarted, using up the run's server restarts."""
    deadline = time.time() + (timeout or 0.0) if parent_pid is None else float("inf")
    while True:
        steps = stable_steps(root)
        if steps:
            return steps[min(steps)]
        if timeout is None:
            raise SystemExit(f"lit-rl evaluate: no STABLE checkpoint under {root / 'weights'}; "
                             "give --follow to wait for a run that is still training")
        if time.time() > deadline:
            raise SystemExit(f"lit-rl evaluate: no STABLE checkpoint appeared under {root / 'weights'} in {timeout:.0f} s")
        if parent_pid is not None and not pid_alive(parent_pid):
            raise SystemExit("lit-rl evaluate: the trainer is gone before any checkpoint was written")
        time.sleep(0.5)


def checked_server_options(options: dict, envs: list | None) -> dict:
    """`--server`'s options, checked before anything starts (a misspelt option named, not a TypeError
    once the first checkpoint is found), and against the environments' completion limits when they
    are built here (beside training, OnlineEval checked them)."""
    if problems := evaluator_server_problems(options, envs or [], where="--server "):
        raise UserError("; ".join(problems))
    return options


def with_gpu_split(server_kwargs: dict) -> dict:
    """`num_infer_gpus: N` among the server options: serve on the node's last N GPUs (extra GPUs
    beyond tensor parallelism become data-parallel ranks); train on the others."""
    n = server_kwargs.pop("num_infer_gpus", None)
    if n is None:
        return server_kwargs
    from lit_rl.inference.gpus import plan_gpus, visible_gpus

    plan = plan_gpus(visible_gpus(), n, server_kwargs.pop("tensor_parallel_size", 1))
    return {**server_kwargs, **plan.server_kwargs()}


def api_key(args: argparse.Namespace) -> str | None:
    """The server's key, from the variable `--api-key-env` names (never on the process list). One
    unset or empty is refused before anything starts: no key was sent, and every eval failed on
    the server's 401."""
    if not args.api_key_env:
        return None
    if not (key := os.environ.get(args.api_key_env)):
        raise UserError(f"--api-key-env {args.api_key_env}: the environment variable {args.api_key_env} is not set "
                        "or is empty; set it to the server's API key")
    return key


def run(args: argparse.Namespace) -> None:
    """Check, wait for the first checkpoint, start the server, then evaluate in an event loop. The
    waits before run outside the loop, where Ctrl-C raises KeyboardInterrupt at once: inside it,
    a Ctrl-C only cancelled the task, which nothing blocking noticed until the server was up."""
    from lit_rl.inference.endpoint import open_endpoint

    root = run_root(args)
    plan = load_plan(args, root)
    key = api_key(args)
    envs = None
    if not args.follow:  # a user's command: a wrong class path or init arg is said before any server starts
        # (Beside training, OnlineEval's plan was built by the trainer already; there they are built
        # after the server starts, as before this check existed.)
        try:
            envs = [instantiate(config) for config in plan.envs]
        except (ValueError, TypeError) as e:
            raise UserError(f"--env / --env-args or the plan's environments: {e}") from e
        if problems := [problem for env in envs if (problem := env.tasks_problem())]:  # rows read, a bad one named
            raise UserError("--env / --env-args or the plan's environments: " + "; ".join(problems))
    server_kwargs = with_gpu_split(checked_server_options(args.server, None if args.base_url else envs))
    logger = EvalLogger(args.log_dir or evals_dir(root), args.wandb)
    model = None
    if args.base_url and not args.follow:
        first_checkpoint(root, None, None)  # a finished run with nothing to evaluate is an error, not an exit 0
    if not args.base_url:
        model = first_checkpoint(root, args.start_timeout if args.follow else None, args.parent_pid)
        server_kwargs.setdefault("log_path", str(evals_dir(root) / "vllm.log"))
        if is_adapter_dir(model):  # LoRA checkpoints: serve their base once, then each step's adapter by name
            model, rank = adapter_base(model)
            server_kwargs = lora_server_options(server_kwargs, rank)
    with contextlib.ExitStack() as stack:
        if model is not None and Path(model).resolve().is_relative_to(root.resolve()):
            # retention keeps the run's directory its server starts (and restarts) on
            stack.enter_context(lease(model, f"evaluator-server-{os.getpid()}"))
        endpoint = stack.enter_context(open_endpoint(base_url=args.base_url, model=model, api_key=key,
                                                     allowed_root=root, **({} if args.base_url else server_kwargs)))
        evaluator = asyncio.run(evaluate(args, root, plan, envs, logger, endpoint))
    if not args.follow:
        say_outcome(evaluator, root)


async def evaluate(args: argparse.Namespace, root: Path, plan: EvalPlan, envs: list | None, logger: EvalLogger,
                   endpoint) -> Evaluator:
    """The evaluator's loop. A restart of its server runs in a thread (`ServerRestarts.recover`) and
    gives up when `stopping` is set: by a Ctrl-C (asyncio.run cancels this task, and its exit waits
    for that thread) or when the trainer it evaluates for is gone. Before, both waited for the
    restarted server to be healthy: a minute or more of a Ctrl-C doing nothing."""
    from lit_rl.inference.restarts import ServerRestarts

    stopping = threading.Event()

    def interrupted() -> bool:
        if args.parent_pid is not None and not pid_alive(args.parent_pid):
            stopping.set()
        return stopping.is_set()

    restarts = ServerRestarts(args.max_server_restarts, None, servers=lambda: {"evaluator": endpoint.server},
                              after_start=lambda role: "its model; the step is reloaded next",
                              interrupted=interrupted)
    async with endpoint.client() as client:
        evaluator = Evaluator(root, plan, client, logger, standalone=not args.follow, parent_pid=args.parent_pid,
                              restarts=restarts, envs=envs)
        try:
            await evaluator.run()
        except asyncio.CancelledError:
            stopping.set()
            raise
        finally:
            logger.close()
    return evaluator


def say_outcome(evaluator: Evaluator, root: Path) -> None:
    """The end of a standalone run: exit 1 naming the evals that failed (each was logged as it
    failed; a rerun tries them again), or say that there was nothing left to evaluate (every due
    eval of the run's checkpoints has succeeded before: its results are in evals/)."""
    if failed := evaluator.failures():
        raise SystemExit(f"lit-rl evaluate: {sum(map(bool, evaluator.attempted.values()))} of "
                         f"{len(evaluator.attempted)} evals failed (a rerun tries them again): " + "; ".join(failed))
    if not evaluator.attempted:
        logging.getLogger("lit_rl.evaluator").info(
            "evaluator: nothing to evaluate: every due eval of the checkpoints under %s succeeded before (%s)",
            root / "weights", evaluator.done.path)


def share_cores_with_training(args: argparse.Namespace) -> None:
    """Beside a training run (`--follow`), this process's own torch work (a custom eval scoring a
    checkpoint with HF, say) runs on one thread unless OMP_NUM_THREADS says otherwise (OnlineEval's
    `cpus` sets it). With torch's default, one thread per core, its threads and the trainer's
    oversubscribe the cores and both crawl: a held-out loss of 20 chats took 9.8 s beside CPU
    training and 0.3 s after it. Child processes (the vLLM server) are not affected."""
    if args.follow and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    args = parse(argv)
    share_cores_with_training(args)
    try:
        run(args)
    except KeyboardInterrupt:  # Ctrl-C (the first: asyncio.run turns its cancel back into this); servers stopped
        print("lit-rl evaluate: stopped (Ctrl-C)", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
