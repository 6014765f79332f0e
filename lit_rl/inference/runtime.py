"""InferenceRuntime: the one owner of a training run's inference servers.

Every process a run serves models from is started, synced and stopped here, and nowhere else:
the policy's vLLM server (RL: rollouts), a frozen teacher's (on-policy distillation, SFT on a
teacher's completions) and the evaluator process with its own server (online evals). The
other parts only say what they need and ask for clients:

- the rollout data module, at setup: `use(policy=..., teacher=..., tokenizer=...)`; when its
  rollouts start: `client_factory("policy" | "teacher")` and `policy_version`, then `on_sync(fn)`
  to hear of each new version, and `before_stop(fn)` to close them before the servers go;
- OnlineEval: `start_evaluator(...)`, `finish_evaluator(...)`.
A run that declares nothing (plain SFT) starts no server.

`lit-rl fit` adds one to every run; its options are the `inference:` section of a config
(`--inference.teacher_model ...`, `--inference.base_url ...`). In Python, put one in
`Trainer(callbacks=[...])`.

Lifecycle (rank 0 owns the processes; exports are collective):
    on_train_start      export the current weights and start the policy's server on them (or make
                        an existing `base_url` server reload them), then the teacher's;
    on_train_batch_end  an evaluator that exited is started again; then the sync: export step k,
                        reload the policy's server, `policy_version = k` (the one record of which
                        weights are served), tell the listeners;
    on_train_end        stop everything;
    on_exception        a graceful stop (SIGTERM, Ctrl-C) first writes its checkpoint
                        (`lit_rl.stopping`), then everything stops: the listeners close their
                        rollouts (requests in flight aborted), then the evaluator and the
                        servers, together (SIGTERM to each process group, SIGKILL after a grace).

Servers that die: a server lit-rl started (the policy's or the teacher's) that exits or stops
answering its health check is started again on the same port, the policy's serving the newest
synced weights with the same version, and every request that failed because of it is made again
(`lit_rl.inference.restarts`); at most `max_server_restarts` per run, then the run fails, its
checkpoint written first (`lit_rl.stopping`). An evaluator process that exits is started again
at the next step, counted among the same restarts; once none is left, training goes on without
evals (`lit_rl.inference.evaluator_process`).

With a LoRA adapter (`model.init_args.lora`) the policy's server serves the frozen base
(`weights/base`, written once) with vLLM's LoRA support on, and a sync loads only the adapter, in
place, under one name (`ADAPTER_NAME`, which every rollout asks for): the same pause, prefix-cache
reset and version as a full reload, a few MB instead of the model.

The transport of a sync is the filesystem (`HFExport.sync_export`, then vLLM's `reload_weights`),
which works wherever the trainer and the server share a disk. vLLM's NCCL weight-transfer
endpoints are the GPU fast path: a subclass overrides `push_weights` and keeps the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_rl import stopping
from lit_rl.errors import ConfigError, UserError
from lit_rl.inference.client import AdapterRefused, InferenceServerError
from lit_rl.inference.endpoint import Endpoint, open_endpoint
from lit_rl.inference.evaluator_process import EvaluatorProcess
from lit_rl.inference.restarts import ServerGone, ServerRestarts
from lit_rl.inference.server import StartInterrupted
from lit_rl.lora import lora_server_options
from lit_rl.model_names import local_model_problem
from lit_rl.run_dir import base_dir, lease
from lit_rl.run_seed import run_seed, with_sampler_seed
from lit_rl.server_options import loads_weights, server_option_problems, typed_server_options, with_server_args

ROLES = ("policy", "teacher")
ADAPTER_NAME = "lit-rl-policy"  # the policy's LoRA adapter, as rollouts ask for it from the server


VLLM_DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs unless told (checked on 0.32)


def with_max_logprobs(options: dict, top_k: int) -> dict:
    """Server options that let a teacher return `top_k` tokens per position: `--max-logprobs` raised
    to it when above vLLM's default, unless the options already set it."""
    if top_k <= VLLM_DEFAULT_MAX_LOGPROBS:
        return options
    return with_server_args(options, ["--max-logprobs", str(top_k)], unless=["--max-logprobs"])


SKIP_TOKENIZER = "--skip-tokenizer-init"


def scoring_only(options: dict) -> dict:
    """Server options for a teacher that only scores the policy's samples (OPD): vLLM's
    `--skip-tokenizer-init`, unless the options already say (`--no-skip-tokenizer-init` keeps it).
    Why: scoring sends token ids and reads logprobs, and without the flag vLLM's API server turns
    every one of the top-k tokens at every position into text for an answer nobody reads; that
    decoding, not the prefill, was most of a scoring request (docs/benchmarks.md, "A teacher that
    only scores"). A teacher that samples (SFT on its completions) keeps its tokenizer: vLLM's
    completions refuse to generate without one (checked on 0.32)."""
    return with_server_args(options, [SKIP_TOKENIZER], unless=[SKIP_TOKENIZER, "--no-skip-tokenizer-init"])


class InferenceRuntime(L.Callback):
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        server: dict | None = None,
        teacher_model: str | None = None,
        teacher_base_url: str | None = None,
        teacher_api_key: str | None = None,
        teacher_server: dict | None = None,
        teacher_tokenizer: str | None = None,
        sync_timeout: float = 300.0,
        logprobs_mode: str | None = None,
        max_server_restarts: int = 3,
        health_check_interval: float = 10.0,
        batch_prompts: bool = True,
    ):
        """
        Args:
            base_url: an existing OpenAI-compatible vLLM server of the policy (started with
                ``VLLM_SERVER_DEV_MODE=1``, able to read this run directory); None: lit-rl starts
                one on the trainer's weights when the run samples from the policy (RL).
            api_key: that server's API key.
            server: options of the policy's managed server (`lit_rl.inference.server.VLLMServer`),
                e.g. ``{dtype: float32, max_model_len: 1024, enforce_eager: true}``.
            teacher_model: a frozen teacher (name or path) for on-policy distillation
                (`lit_rl.modules.OPD`: it scores every sampled token) or SFT on its completions
                (``data.source: teacher``); lit-rl starts a vLLM server for it unless
                `teacher_base_url` is given. It must share the policy's tokenizer (checked first).
            teacher_base_url: an existing vLLM server of the teacher.
            teacher_api_key: that server's API key.
            teacher_server: options of the teacher's managed server (as `server`).
            teacher_tokenizer: the tokenizer (hub name or local path) of the model served at
                `teacher_base_url`, for the check that it shares the policy's; None: read from the
                served model's directory, which works only when that directory is on this
                machine or is a hub name (a teacher on another host usually needs this).
            sync_timeout: seconds one reload of the policy's server may take before the run fails.
            logprobs_mode: the ``--logprobs-mode`` the existing `base_url` server was started with,
                which vLLM does not report: ``processed_logprobs`` lets a run sample at temperature
                != 1 or with top-k/top-p (the trainer compares the sampled distribution's logprobs,
                `lit_rl.sampling_process`). The servers lit-rl starts always use it.
            max_server_restarts: how many times in a run the servers lit-rl started may be
                restarted after one died or stopped answering (all roles together); 0: never,
                the first such failure ends the run (its checkpoint written first).
            health_check_interval: seconds between the watchdog's checks of those servers
                (process alive, `/health` answers); None or 0: no watchdog, a dead server is
                found by the next request that fails.
            batch_prompts: the rollouts' (and the teacher's scoring) calls made at the same moment
                with the same settings go to the server as one request (`lit_rl.inference.batching`:
                less CPU and wall time per step; each call then gets its answer when the request's
                longest completion ends). False: one request per call.
        """
        self.base_url, self.api_key, self.server = base_url, api_key, typed_server_options(server or {})
        self.teacher_model, self.teacher_base_url = teacher_model, teacher_base_url
        self.teacher_api_key, self.teacher_server = teacher_api_key, typed_server_options(teacher_server or {})
        self.teacher_tokenizer = teacher_tokenizer
        self.logprobs_mode = logprobs_mode
        self.max_server_restarts, self.health_check_interval = max_server_restarts, health_check_interval
        problems = self.option_problems()
        if problems:
            raise ValueError("inference: " + "; ".join(problems))
        self.sync_timeout = sync_timeout
        self.batch_prompts = batch_prompts
        self.serves_policy = False  # set by `use`: a run that samples from the policy
        self.serves_teacher = False  # ... or from a teacher, or scores with one
        self.tokenizer_name: str | None = None
        self.trust_remote_code = False
        self.teacher_top_k = 0  # the teacher's top tokens per position a dense divergence asks for
        self.policy_version: int | None = None  # the optimizer steps whose weights the policy's server serves
        self.endpoints: dict[str, Endpoint] = {}
        self.evaluator: EvaluatorProcess | None = None
        self.last_sync_s = 0.0
        self._listeners: list[Callable[[int], None]] = []
        self._before_stop: list[Callable[[], None]] = []
        self._lease = None
        self._exporter = None
        self.lora = None  # the policy's LoRAOptions, read from the module when training starts
        self._served: Path | None = None  # the newest weights the policy's server was made to serve
        self._trainer = None
        self.restarts = self._new_restarts()

    # ---- what the run's parts declare and ask ---------------------------------------------------
    @staticmethod
    def of(trainer) -> InferenceRuntime:
        """The run's runtime (the one in `trainer.callbacks`)."""
        found = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, InferenceRuntime)]
        if len(found) != 1:
            raise ValueError(f"this run needs exactly one lit_rl.inference.InferenceRuntime in trainer.callbacks, "
                             f"found {len(found)} (lit-rl fit adds one; configure it under `inference:`)")
        return found[0]

    def option_problems(self) -> list[str]:
        problems = []
        if self.base_url and self.server:
            problems.append("give inference.base_url (an existing server) or inference.server options, not both")
        if self.teacher_base_url and self.teacher_server:
            problems.append("give inference.teacher_base_url (an existing server) or inference.teacher_server "
                            "options, not both")
        if self.teacher_base_url and self.teacher_model:
            problems.append("give inference.teacher_base_url (an existing server) or inference.teacher_model (lit-rl "
                            "starts a server for it), not both")
        if self.teacher_tokenizer and not self.teacher_base_url:
            problems.append("inference.teacher_tokenizer names the tokenizer of the server at inference.teacher_base_url, "
                            "which is not set (a teacher_model's own tokenizer is read from it)")
        if self.logprobs_mode not in (None, "raw_logprobs", "processed_logprobs"):
            problems.append(f"inference.logprobs_mode must be raw_logprobs or processed_logprobs (the existing "
                            f"server's --logprobs-mode), got {self.logprobs_mode!r}")
        if not (isinstance(self.max_server_restarts, int) and self.max_server_restarts >= 0):
            problems.append(f"inference.max_server_restarts must be an integer >= 0, got {self.max_server_restarts!r}")
        if self.health_check_interval is not None and self.health_check_interval < 0:
            problems.append(f"inference.health_check_interval must be >= 0 seconds (0: no watchdog), got "
                            f"{self.health_check_interval!r}")
        for name, options in (("server", self.server), ("teacher_server", self.teacher_server)):
            problems += server_option_problems(options, where=f"inference.{name}.")
        weights = loads_weights(self.teacher_server.get("extra_args"))
        if self.teacher_model and (problem := local_model_problem(self.teacher_model, weights=weights)):
            problems.append(f"inference.teacher_model {self.teacher_model}{problem}")
        if self.teacher_server and not self.teacher_model:
            problems.append("inference.teacher_server options need inference.teacher_model (the model to start a "
                            "server for)")
        return problems

    @property
    def has_teacher(self) -> bool:
        return bool(self.teacher_model or self.teacher_base_url)

    def use(self, *, policy: bool, teacher: bool, tokenizer: str, trust_remote_code: bool = False,
            teacher_top_k: int = 0) -> None:
        """Declared at setup by the part that samples: whether the policy is served (and synced
        after every step), whether the teacher is, the policy's tokenizer, which a teacher must
        share, and how many of the teacher's top tokens per position a dense divergence asks for.
        A run that declares nothing (plain SFT) starts no server."""
        self.serves_policy, self.serves_teacher = policy, teacher and self.has_teacher
        self.tokenizer_name, self.trust_remote_code = tokenizer, trust_remote_code
        self.teacher_top_k = teacher_top_k

    def client_factory(self, role: str, **kwargs) -> Callable[[], Any]:
        """A no-argument factory of `InferenceClient`s of the `role` server (rank 0, once started):
        clients belong to the event loop that makes them, so the caller makes its own."""
        if role not in self.endpoints:
            raise RuntimeError(f"InferenceRuntime: no {role} server is running (started: {sorted(self.endpoints)})")
        endpoint = self.endpoints[role]
        if role == "policy" and self.lora is not None:
            kwargs.setdefault("model", ADAPTER_NAME)
        kwargs.setdefault("batch_prompts", self.batch_prompts)
        return lambda: endpoint.client(**kwargs)

    def on_sync(self, listener: Callable[[int], None]) -> None:
        """`listener(version)` after each sync, once the policy's server serves that version."""
        self._listeners.append(listener)

    def before_stop(self, callback: Callable[[], None]) -> None:
        """`callback()` before the servers stop (e.g. close rollouts, so no request is left in flight)."""
        self._before_stop.append(callback)

    # ---- start ----------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        problems = self.option_problems()
        if problems:
            raise ValueError("inference: " + "; ".join(problems))

    def on_train_start(self, trainer, pl_module) -> None:
        self._trainer, self.restarts = trainer, self._new_restarts()  # a run's restarts count from 0
        if not (self.serves_policy or self.serves_teacher):
            if self.has_teacher or self.base_url or self.server:
                rank_zero_warn("inference: server options are set, but nothing in this run samples from a model "
                               "(a RolloutDataModule does); no server is started")
            return
        step = trainer.global_step
        self.lora = getattr(pl_module, "lora", None) if self.serves_policy else None
        weights = self._export(trainer, pl_module, step) if self.serves_policy else None
        self._served = weights
        if trainer.is_global_zero:
            started = time.perf_counter()
            with stopping.stops_on_request(trainer, "starting the inference servers"):
                try:
                    self._start_servers(trainer, weights, step)
                except StartInterrupted:
                    raise stopping.stop(trainer, "stopped while an inference server was starting") from None
            what = f"the weights of step {step}" if self.serves_policy else "the teacher"
            rank_zero_info(f"InferenceRuntime: serving {what} ({time.perf_counter() - started:.0f} s to start)")
            self.restarts.start_watchdog()
        trainer.strategy.barrier("inference_start")
        if self.serves_policy:
            self.policy_version = step

    def _start_servers(self, trainer, weights: Path | None, step: int) -> None:
        from lit_rl.model_names import load_tokenizer
        from lit_rl.rollouts.teacher import tokenizer_mismatch

        root = Path(trainer.default_root_dir).resolve()
        interrupt = self._interrupted
        tokenizer = None
        if self.serves_teacher:  # before any server starts: a teacher must read the policy's ids as it does
            tokenizer = load_tokenizer(self.tokenizer_name, trust_remote_code=self.trust_remote_code)
            if self.teacher_model:
                self._check_teacher(tokenizer_mismatch(tokenizer, load_tokenizer(
                    self.teacher_model, trust_remote_code=self.trust_remote_code)))
        if self.serves_teacher and self.teacher_base_url is not None:  # checked before any server starts
            self._open_teacher(root, tokenizer, step)
        if self.serves_policy:
            options = {}
            served = weights if self.lora is None else base_dir(root)  # LoRA: the base, and the adapter loaded on it
            if self.base_url is None:
                options = {"log_path": root / "vllm.log", "stop_on_sigterm": False, **self.server}
                if self.lora is not None:
                    options = lora_server_options(options, self.lora.rank)
                # the run's seed, moved on by the step at a resume (not the start's draws again)
                options = with_sampler_seed(options, run_seed() + step)
                self._lease = lease(served, "server")  # retention keeps the directory it was started on
                self._lease.__enter__()
                rank_zero_info(f"InferenceRuntime: starting the policy's vLLM on {served} (log: {options['log_path']})")
            self.endpoints["policy"] = open_endpoint(base_url=self.base_url, model=served, api_key=self.api_key,
                                                     allowed_root=root, interrupt=interrupt, **options)
            if self.base_url is not None or self.lora is not None:  # serve exactly the weights being trained
                self._reload(weights)
        if self.serves_teacher and self.teacher_base_url is None:
            self._open_teacher(root, tokenizer, step)

    def _open_teacher(self, root: Path, tokenizer, step: int) -> None:
        """The teacher's endpoint: its managed server started (`--max-logprobs` raised to the
        divergence's top k; seeded as the policy's, for the completions it samples when it is the
        data's source; without a tokenizer when it only scores, `scoring_only`), or an existing
        server checked (tokenizer, top k) before any other server starts."""
        from lit_rl.rollouts.teacher import tokenizer_mismatch

        options = {}
        if self.teacher_base_url is None:
            options = self.teacher_server_options(root, step)
            rank_zero_info(f"InferenceRuntime: starting the teacher's vLLM on {self.teacher_model} "
                           f"(log: {options['log_path']})")
        self.endpoints["teacher"] = open_endpoint(base_url=self.teacher_base_url, model=self.teacher_model,
                                                  api_key=self.teacher_api_key, interrupt=self._interrupted, **options)
        if not self.teacher_model:  # only the server (or teacher_tokenizer) knows what it serves
            self._check_teacher(tokenizer_mismatch(tokenizer, self._teacher_tokenizer()))
        if self.teacher_base_url and self.teacher_top_k > VLLM_DEFAULT_MAX_LOGPROBS:
            self._check_teacher(asyncio.run(self._top_k_refusal()))

    def teacher_server_options(self, root: Path, step: int) -> dict:
        """The options of the teacher's managed server in a run in `root` starting at `step`."""
        options = {"log_path": root / "vllm_teacher.log", "dev_mode": False, "stop_on_sigterm": False,
                   **self.teacher_server}
        options = with_sampler_seed(with_max_logprobs(options, self.teacher_top_k), run_seed() + step)
        return scoring_only(options) if self.serves_policy else options  # the policy samples: the teacher scores

    def _check_teacher(self, problem: str | None) -> None:
        if problem:
            raise ConfigError(f"InferenceRuntime: the teacher {self.teacher_model or self.teacher_base_url} {problem}")

    def _teacher_tokenizer(self):
        """The tokenizer of the server at `teacher_base_url`: `teacher_tokenizer`, else its served
        model's (a local directory or a hub name), else a ConfigError saying what to set."""
        from lit_rl.model_names import load_tokenizer

        if self.teacher_tokenizer:
            return load_tokenizer(self.teacher_tokenizer)
        try:
            return asyncio.run(self._served_tokenizer("teacher"))
        except UserError as e:
            raise ConfigError(f"InferenceRuntime: cannot check that the teacher at {self.teacher_base_url} shares the "
                              f"policy's tokenizer: {e}. Set inference.teacher_tokenizer to its tokenizer (a hub name, "
                              "or a path on this machine)") from e

    async def _served_tokenizer(self, role: str):
        async with self.endpoints[role].client() as client:
            return await client.tokenizer()

    async def _top_k_refusal(self) -> str | None:
        """Why an existing teacher server cannot return `teacher_top_k` tokens per position (its
        `--max-logprobs` is below it), asked with one two-token scoring request before training,
        instead of every rollout's scoring failing once training has begun."""
        from lit_rl.inference.client import InferenceRequestError

        async with self.endpoints["teacher"].client() as client:
            try:
                await client.score_top_k([0, 0], self.teacher_top_k)
            except InferenceRequestError as e:
                return (f"cannot return model.init_args.teacher_top_k={self.teacher_top_k} tokens per position "
                        f"({e}): start it with --max-logprobs {self.teacher_top_k} or more, or lower teacher_top_k")
        return None

    # ---- weight sync ----------------------------------------------------------------------------
    def _export(self, trainer, pl_module, step: int) -> Path:
        """The current weights (of `step`) on disk for the policy's server. Collective."""
        return self._run_exporter(trainer).sync_export(trainer, pl_module, step)

    def _run_exporter(self, trainer):
        """The run's HFExport (it owns every export; a default one when the config has none), whose
        retention then spares what the policy's server serves (`needs`)."""
        from lit_rl.callbacks.export import HFExport

        if self._exporter is None:
            found = [c for c in trainer.callbacks if isinstance(c, HFExport)]
            self._exporter = found[0] if found else HFExport()
            self._exporter.register(self)
        return self._exporter

    # HFExport's consumer interface: the sync writes its own weights, and what the server serves stays
    # on disk until newer weights are loaded: a restart before then loads it again (`_serve_again`)
    def export_due(self, step: int) -> bool:
        return False

    def needs(self, path: Path) -> bool:
        return self._served is not None and Path(path).resolve() == self._served.resolve()

    def _new_restarts(self) -> ServerRestarts:
        return ServerRestarts(
            self.max_server_restarts, self.health_check_interval, interrupted=self._interrupted,
            servers=lambda: {role: endpoint.server for role, endpoint in self.endpoints.items()},
            after_start=self._serve_again)

    @property
    def server_restarts(self) -> int:
        """Restarts of the servers lit-rl started, in this run."""
        return self.restarts.count

    def _interrupted(self) -> bool:
        """Whether a server start should give up: a stop was asked for, or the servers are stopping."""
        return self.restarts.closing or stopping.requested(self._trainer)

    def _serve_again(self, role: str) -> str:
        """After a restart: the policy's server serves the newest synced weights again."""
        if role != "policy" or self._served is None:
            return "the teacher" if role == "teacher" else "its model"
        self._load(self._served)
        return f"the weights of step {self.policy_version}"

    def _reload(self, weights: Path) -> int:
        """The policy's server serves `weights` (its version: their step), restarting it first if
        it died (`ServerRestarts.recover`)."""
        while True:
            seen = self.restarts.generation("policy")
            try:
                with self.restarts.lock:
                    version = self._load(weights)
                    self._served = weights
                    return version
            except (InferenceServerError, TimeoutError) as e:  # TimeoutError: sync_timeout
                if not self.restarts.recover("policy", seen, e):
                    raise

    def _load(self, weights: Path) -> int:
        async def reload() -> int:
            async with self.endpoints["policy"].client() as client:
                if self.lora is None:
                    return await asyncio.wait_for(client.reload_weights(weights), self.sync_timeout)
                return await asyncio.wait_for(client.reload_adapter(weights, ADAPTER_NAME), self.sync_timeout)

        try:
            return asyncio.run(reload())
        except AdapterRefused as e:
            where = "the policy's server" if self.base_url is None else f"inference.base_url {self.base_url}"
            raise ConfigError(f"model.lora (rank {self.lora.rank}): {where} cannot serve this adapter: {e}") from e

    def push_weights(self, trainer, pl_module, step: int) -> None:
        """Make the policy's server serve the current weights of `step`. The filesystem path:
        export (collective), then reload on rank 0. A GPU subclass may push tensors instead."""
        weights = self._export(trainer, pl_module, step)
        if trainer.is_global_zero:
            self._reload(weights)

    def sync(self, trainer, pl_module, step: int) -> None:
        """After optimizer step `step`: the policy's server serves its weights, and the listeners
        hear of version `step`. Collective."""
        with stopping.stops_on_request(trainer, f"the weight sync of step {step}"):
            error = None
            try:
                self.push_weights(trainer, pl_module, step)
            except Exception as e:
                error = e
            # rank 0's error reaches every rank (they fail and save together); this is the barrier
            stopping.raise_on_every_rank(trainer, error, f"the weight sync of step {step}")
            if error is not None:  # another rank's own
                raise error
        self.policy_version = step
        if trainer.is_global_zero:
            for listener in self._listeners:
                listener(step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.evaluator is not None:  # rank 0, with online evals
            self._keep_evaluator(trainer)
        if self.serves_policy:
            step = trainer.global_step
            last = trainer.max_steps > 0 and step >= trainer.max_steps
            self.last_sync_s = 0.0
            if not (last or stopping.requested(trainer)):  # else no rollout will be drawn from these weights
                started = time.perf_counter()
                self.sync(trainer, pl_module, step)
                self.last_sync_s = time.perf_counter() - started
            pl_module.log("train/weight_sync_s", self.last_sync_s, on_step=True, on_epoch=False, batch_size=1)
        if self.serves_policy or self.evaluator is not None:
            pl_module.log("train/server_restarts", float(self.server_restarts), on_step=True, on_epoch=False,
                          batch_size=1, rank_zero_only=True)

    # ---- the evaluator --------------------------------------------------------------------------
    def start_evaluator(self, command: list[str], *, env: dict[str, str], log_path: Path,
                        cpus: list[int] | None = None) -> EvaluatorProcess:
        """Start the evaluator process (rank 0); it stops with the run, after its checkpoint."""
        self.evaluator = EvaluatorProcess(command, env=env, log_path=log_path, cpus=cpus)
        return self.evaluator

    def _keep_evaluator(self, trainer) -> None:
        """After each step (rank 0): an evaluator that exited is started again, a restart of the
        run's. Once none is left, training goes on without online evals (an eval never stops
        training), with a warning; the end of the run names its exit code again."""
        evaluator = self.evaluator
        if evaluator.given_up or stopping.requested(trainer):  # (a stop stops it anyway)
            return
        code = evaluator.exit_code()
        if code is None:
            return
        try:
            self.restarts.begin("the evaluator", f"exited (code {code})", None, evaluator.log_path)
        except ServerGone as e:
            evaluator.given_up = True
            cause = str(e).splitlines()[0].split("; last lines of ")[0]
            rank_zero_warn(f"InferenceRuntime: {cause}; training goes on without online evals (its log: "
                           f"{evaluator.log_path})")
            return
        evaluator.start()
        rank_zero_info(f"InferenceRuntime: the evaluator is started again (pid {evaluator.pid})")

    def finish_evaluator(self, timeout: float) -> int | None:
        """Wait up to `timeout` s for the evaluator to finish its last eval; its exit code, or
        None if it had to be stopped."""
        if self.evaluator is None:
            return None
        try:
            return self.evaluator.wait(timeout)
        finally:
            self._stop_evaluator()

    def _stop_evaluator(self) -> None:
        evaluator, self.evaluator = self.evaluator, None
        if evaluator is not None:
            evaluator.stop()

    # ---- stop -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop everything this run serves from (idempotent): the listeners' rollouts first, then
        the evaluator and the servers together."""
        self.restarts.close()  # the watchdog and any restart under way give up
        callbacks, self._before_stop, self._listeners = self._before_stop, [], []
        for callback in callbacks:
            callback()
        endpoints, self.endpoints = list(self.endpoints.values()), {}
        if endpoints or self.evaluator is not None:
            if any(e.server is not None for e in endpoints):
                rank_zero_info("InferenceRuntime: stopping the inference servers")
            with ThreadPoolExecutor(max_workers=len(endpoints) + 1) as pool:
                list(pool.map(lambda stop: stop(), [self._stop_evaluator, *(e.stop for e in endpoints)]))
        if self._lease is not None:
            self._lease.__exit__(None, None, None)
            self._lease = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.stop()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        try:
            stopping.save_before_stopping(trainer, exception)
        finally:  # a second Ctrl-C during that save still stops every server
            self.stop()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.stop()
