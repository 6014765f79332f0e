"""RolloutDataModule: training batches from live rollouts of the policy (or of a frozen teacher).

Each batch is one optimizer step: `batch_size` samples (`batch_size / group_size` tasks of
the environment, `group_size` completions each) from the `RolloutBuffer`, with group-relative
advantages, packed by the same `build_step` as static data. The buffer runs on its own
event loop thread (`ThreadedRolloutBuffer`); the trainer side only asks for the next batch.
This module is only about data: where the samples come from, how they are shaped, and where
the run is in them. The servers it samples from belong to the run's `InferenceRuntime`
(`lit_rl.inference.runtime`), which starts, syncs and restarts them; this module asks it for clients
and for the policy version they serve.

Why batches are drawn inside the step: Lightning fetches one batch ahead of the step it
trains. Drawn there, batch k would be requested while the weights of step k-1 are still
training, which with `max_staleness=0` either deadlocks (the scheduler may not start
batch k's rollouts before version k) or trains rollouts one version too old. So the
DataLoader yields only a step number, and `on_before_batch_transfer` (called right before
each `training_step`, after the previous step's weight sync) swaps in the real batch:
batch k is drawn only once version k is being served. The rollouts start with the first
draw. Under several ranks rank 0 runs the buffer; every rank gets an equal share of each
batch (a broadcast inside the step).

Static rows can ride along (`replay`: a list of `ReplaySource`): each batch then takes a
fixed share of samples from each source by sampling weight, each source's samples feed
their own loss (replay rows: cross-entropy) normalised by that source's own token count
(`lit_rl.data.mixing`), and metrics are logged per source as `train/<source>/...`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_rl import stopping
from lit_rl.data.datamodules import layout_problems, resolve_tokenizer_name
from lit_rl.data.held_batch import HeldBatch
from lit_rl.data.mixing import build_mixed_step
from lit_rl.data.rank_share import from_wire, rank_share, to_wire
from lit_rl.data.replay import ReplayMix, ReplaySource
from lit_rl.data.rollout_traces import rewind_traces, rollout_stats, trace_batch, trace_share
from lit_rl.data.samples import SAMPLERS
from lit_rl.data.step_builder import build_step
from lit_rl.errors import ConfigError
from lit_rl.inference.runtime import InferenceRuntime
from lit_rl.model_names import load_tokenizer
from lit_rl.rollouts.buffer import RolloutBuffer, rollout_option_problems
from lit_rl.rollouts.context import TrainSampling, sampling_problems
from lit_rl.rollouts.envs import Environment
from lit_rl.rollouts.filters import GibberishFilter, RepetitionFilter
from lit_rl.rollouts.scheduler import StalenessScheduler
from lit_rl.rollouts.threaded import Interrupted, ThreadedRolloutBuffer
from lit_rl.run_seed import order_seed
from lit_rl.sampling_process import RAW, SamplingProcess
from lit_rl.server_options import completion_room_problem

log = logging.getLogger(__name__)

FILTERS = ("gibberish", "repetition")
#: said at the start of a run without trainer.max_steps: its loader never ends an epoch
ENDLESS = ("trainer.max_steps is not set: rollouts never end an epoch, so this run trains until trainer.max_time "
           "(when set) or until it is stopped (Ctrl-C or SIGTERM save a checkpoint first); trainer.max_epochs has "
           "no effect here")


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        env: Environment,
        batch_size: int = 32,
        group_size: int = 8,
        max_concurrency: int | None = None,
        max_staleness: int | None = 1,
        drop_stale: bool = False,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        scale: str = "group",
        skip_zero_advantage: bool = False,
        enforce_filters: list[str] | None = None,
        num_retries: int = 2,
        on_failure: str = "reject",
        max_consecutive_failures: int | None = 16,
        requests_per_minute: float | None = None,
        seed: int | None = None,
        micro_batch_tokens: int = 8192,
        packing: str = "padded",
        pack_length: int | None = None,
        batch_timeout: float = 900.0,
        progress_every: int = 10,
        tokenizer: str | None = None,
        chat_template_kwargs: dict | None = None,
        source: str = "policy",
        weight: float = 1.0,
        replay: list[ReplaySource] | None = None,
    ):
        """
        Args:
            env: the environment (tasks, reward, and optionally its own multi-turn `rollout`),
                e.g. ``lit_rl.rollouts.ReverseTextEnv``.
            batch_size: samples per optimizer step (over all ranks), a multiple of group_size.
            group_size: completions per task; advantages are relative to the task's group.
            max_concurrency: samples in flight at most; None: 2 x batch_size.
            max_staleness: optimizer steps a sample's policy may lag the step that trains it;
                0 is synchronous on-policy RL, None unbounded.
            drop_stale: drop groups that finish too old (and spawn replacements) instead of
                throttling spawning so that none ever does.
            max_tokens: completion length limit of a rollout.
            temperature, top_p, top_k: training sampling (no seed: a fresh draw every request).
            scale: advantage scale: ``group`` (divide by the group's reward std), ``batch``
                (the batch's std) or ``none`` (reward minus group mean only).
            skip_zero_advantage: reject groups whose rewards are all equal (nothing to learn);
                ``max_consecutive_failures`` batches of them in a row are fatal.
            enforce_filters: rollout filters whose hits get a zero loss (``gibberish``,
                ``repetition``); both are always measured.
            num_retries: retries of a failed rollout before it is rejected (or raised).
            on_failure: ``reject`` or ``raise`` once a rollout's retries are spent.
            max_consecutive_failures: this many rejected rollouts in a row (none accepted in
                between) stop the run: a broken environment or reward function fails fast
                instead of drawing task after task. None: never.
            requests_per_minute: pace rollout starts for rate-limited endpoints.
            seed: seed of the task order; None: the run's ``seed_everything`` (lit_rl/run_seed.py).
            micro_batch_tokens, packing, pack_length: the layout of a step, as in
                `StaticDataModule`.
            batch_timeout: seconds a step may wait for its batch before failing with the
                rollouts' state.
            progress_every: print a rollout progress line every N steps (0: never).
            tokenizer: tokenizer name or path; defaults to the model's. Another one (another chat
                template) must have the model's vocabulary, or the run is refused before the model loads.
            chat_template_kwargs: extra variables for the chat template.
            source: who samples the completions: ``policy`` (the model being trained, through
                its own server, synced after every step; GRPO, OPD) or ``teacher`` (the frozen
                teacher of ``inference.teacher_model`` / ``inference.teacher_base_url``: its
                completions are cross-entropy data for SFT, its exact token ids trained as they
                are). The servers are the run's `InferenceRuntime`'s (the ``inference:`` options).
            weight: the rollouts' sampling weight against the `replay` sources' weights (only
                matters with replay).
            replay: static datasets mixed into every batch (`lit_rl.data.replay.ReplaySource`:
                path, weight, name, ...): their rows feed the cross-entropy loss, normalised by
                their own token count, beside the rollouts' loss. `batch_size` then counts the
                samples of all sources; `group_size` applies to the rollouts only.
        """
        super().__init__()
        self.env = env
        self.batch_size, self.group_size = batch_size, group_size
        self.max_concurrency = max_concurrency if max_concurrency is not None else 2 * batch_size
        self.max_staleness, self.drop_stale = max_staleness, drop_stale
        self.max_tokens, self.temperature, self.top_p, self.top_k = max_tokens, temperature, top_p, top_k
        self.scale, self.skip_zero_advantage = scale, skip_zero_advantage
        self.enforce_filters = list(enforce_filters or [])
        self.num_retries, self.on_failure, self.requests_per_minute = num_retries, on_failure, requests_per_minute
        self.max_consecutive_failures = max_consecutive_failures
        self.seed = seed
        self.micro_batch_tokens, self.packing, self.pack_length = micro_batch_tokens, packing, pack_length
        self.batch_timeout, self.progress_every = batch_timeout, progress_every
        self.tokenizer_name, self.chat_template_kwargs = tokenizer, chat_template_kwargs
        self.source = source
        self.weight, self.replay = weight, list(replay or [])
        self.mix = ReplayMix(self.replay, rollout_name=source, rollout_weight=weight)
        self.runtime: InferenceRuntime | None = None  # the run's servers (found at setup)
        self.rollouts: ThreadedRolloutBuffer | None = None
        self._saved_state: dict | None = None
        self._held: HeldBatch | None = None  # the batch whose updates are under way
        self._traces_rewound = False

    # ---- set-up and validation ---------------------------------------------------------------
    def option_problems(self) -> list[str]:
        problems = []
        if self.group_size < 1 or self.batch_size < 1 or (self.batch_size % self.group_size and not self.replay):
            problems.append(f"data.batch_size ({self.batch_size}) must be a positive multiple of data.group_size "
                            f"({self.group_size})")
        problems += layout_problems(self.packing, self.micro_batch_tokens, self.pack_length)
        unknown = set(self.enforce_filters) - set(FILTERS)
        if unknown:
            problems.append(f"data.enforce_filters: unknown {sorted(unknown)}; known: {list(FILTERS)}")
        if self.source not in SAMPLERS:
            problems.append(f"data.source must be one of {SAMPLERS}, got {self.source!r}")
        problems += self.mix.problems()
        problems += self.mix.layout_problems(self.micro_batch_tokens, self.packing, self.pack_length)
        if self.batch_timeout <= 0:
            problems.append(f"data.batch_timeout must be > 0, got {self.batch_timeout}")
        # the buffer's own checks, here before any server starts (its batch shape is checked above)
        problems += [f"data.{p}".replace(" or None", " or null") for p in rollout_option_problems(
            batch_size=1, group_size=1, max_concurrency=self.max_concurrency, max_staleness=self.max_staleness,
            num_retries=self.num_retries, on_failure=self.on_failure, scale=self.scale,
            max_consecutive_failures=self.max_consecutive_failures, requests_per_minute=self.requests_per_minute)]
        if not isinstance(self.env, Environment) and not callable(getattr(self.env, "rollout", None)):
            problems.append(f"data.env must be an Environment, got {type(self.env).__name__}")
        elif isinstance(self.env, Environment):
            if problem := self.env.tasks_problem():
                problems.append(f"data.env ({type(self.env).__name__}): {problem}")
        problems += self._sampling_problems()
        if self.temperature == 0 and self.group_size > 1:
            problems.append(f"data.temperature 0 is greedy: the {self.group_size} completions of a task "
                            f"(data.group_size) would all be the same, and vLLM refuses n > 1 for greedy "
                            "sampling; set data.temperature > 0, or data.group_size 1")
        return problems

    def setup(self, stage: str | None = None) -> None:
        problems = self.option_problems()
        world = self.trainer.world_size if self.trainer is not None else 1
        if world > 1 and self.batch_size % world:
            problems.append(f"data.batch_size ({self.batch_size}) must be divisible by the number of ranks ({world})")
        if stage not in (None, "fit"):
            problems.append(f"RolloutDataModule trains only (lit-rl fit); {stage!r} needs held-out data")
        if self.trainer is not None:
            problems += self._trainer_problems()
        if self.mix and self.trainer is not None:
            module = self.trainer.lightning_module
            kind = getattr(module, "loss_kind", None)
            self.mix.open(tokenizer=self.resolve_tokenizer(), chat_template_kwargs=self.chat_template_kwargs,
                          trust_remote_code=bool(getattr(module, "trust_remote_code", False)),
                          rollout_loss="cross_entropy" if self.source == "teacher" else (kind or "own"),
                          group_size=self.group_size, world_size=world, batch_size=self.batch_size, problems=problems)
        if problems:
            raise ValueError("RolloutDataModule: " + str(len(problems)) + " problem(s):\n  - " + "\n  - ".join(problems))
        if self.trainer is not None and self._num_steps() is None:
            rank_zero_warn(ENDLESS)
        if self.trainer is not None:
            module = self.trainer.lightning_module
            self.runtime.use(policy=self.source == "policy", teacher=True, tokenizer=self.resolve_tokenizer(),
                             trust_remote_code=bool(getattr(module, "trust_remote_code", False)),
                             teacher_top_k=self._teacher_top_k())

    def _trainer_problems(self) -> list[str]:
        """What this source cannot do with the run's module and servers (the runtime's option
        problems included, so that every problem is reported at once)."""
        try:
            self.runtime = InferenceRuntime.of(self.trainer)
        except ValueError as e:
            return [str(e)]
        problems = self.runtime.option_problems()
        kind = getattr(self.trainer.lightning_module, "loss_kind", None)
        if self.source == "policy" and kind == "cross_entropy":
            problems.append("SFT may not train on the policy's own samples (data.source 'policy'): sample from a "
                            "teacher (data.source 'teacher') or train on a dataset (StaticDataModule)")
        if self.source == "policy" and kind == "policy_gradient" and self.group_size == 1:
            problems.append("data.group_size 1: a completion's advantage is its reward minus the mean of its task's "
                            "group, so with one completion per task every advantage is 0 and the policy-gradient "
                            "loss learns nothing; set data.group_size >= 2")
        if (self.source == "policy" and kind == "distillation" and self.group_size == 1
                and getattr(self.trainer.lightning_module, "reward_weight", 0)):
            problems.append("model.init_args.reward_weight mixes the group's reward advantage into OPD's, and with "
                            "data.group_size 1 every such advantage is 0 (reward minus its group's mean): set "
                            "data.group_size >= 2, or reward_weight 0")
        if self.source == "policy" and kind == "policy_gradient" and self.runtime.has_teacher:
            problems.append("a teacher (inference.teacher_model or inference.teacher_base_url) scores every sample for "
                            "OPD, and GRPO would not use a score: remove it, or train lit_rl.modules.OPD")
        limit = getattr(self.trainer.lightning_module, "max_completion_length", None)
        if getattr(self.trainer.lightning_module, "loss_type", None) == "dr_grpo" and limit and limit < self.max_tokens:
            problems.append(f"model.init_args.max_completion_length ({limit}) is below data.max_tokens ({self.max_tokens}): "
                            "dr_grpo divides every sequence's loss by it, so it must be at least the longest completion")
        sampler, options = ("server", self.runtime.server) if self.source == "policy" else (
            "teacher_server", self.runtime.teacher_server)
        if problem := completion_room_problem(self.max_tokens, options, what="data.max_tokens",
                                              where=f"inference.{sampler}."):
            problems.append(problem)
        if (self.source == "policy" and self.runtime.base_url and self.runtime.logprobs_mode != "processed_logprobs"
                and not self._sampling_problems() and not self.sampling_process.is_identity):
            problems.append(f"data.temperature {self.temperature}, top_p {self.top_p}, top_k {self.top_k} sample from "
                            "a processed distribution, and an existing policy server (inference.base_url) reports "
                            "raw T=1 logprobs unless started with --logprobs-mode processed_logprobs (vLLM does not "
                            "say which): start it so and set inference.logprobs_mode processed_logprobs, or sample "
                            "at temperature 1 without top_p/top_k")
        if self.source == "teacher":
            if not self.runtime.has_teacher:
                problems.append("data.source 'teacher' needs a model to sample from: set inference.teacher_model "
                                "(lit-rl starts a server for it) or inference.teacher_base_url (an existing server)")
            if self.runtime.base_url or self.runtime.server:
                problems.append("inference.base_url and inference.server are the policy's server; data.source "
                                "'teacher' samples from the teacher (inference.teacher_model, inference.teacher_base_url)")
            if self.skip_zero_advantage:
                problems.append("data.skip_zero_advantage rejects every group whose rewards are all equal; with "
                                "data.source 'teacher' the reward is only a metric, so it would drop the teacher's "
                                "completions of the prompts it answers equally well (all of them right, say): set it false")
            if kind not in (None, "cross_entropy"):
                problems.append(f"data.source {self.source!r} is not the policy's own samples, so it can only feed a "
                                f"cross-entropy loss (lit_rl.modules.SFT), not {kind} "
                                f"({type(self.trainer.lightning_module).__name__})")
        return problems

    def resolve_tokenizer(self) -> str:
        return resolve_tokenizer_name(self)

    @property
    def has_teacher(self) -> bool:
        """Whether the policy's samples come scored by a teacher (`teacher_logprobs`: what OPD
        trains on); the run's `InferenceRuntime` serves the teacher. Known after `setup`."""
        return self.source == "policy" and self.runtime is not None and self.runtime.has_teacher

    def _sampling_problems(self) -> list[str]:
        return sampling_problems(self.max_tokens, self.temperature, self.top_p, self.top_k, prefix="data.")

    @property
    def sampling_process(self) -> SamplingProcess:
        """The distribution the policy's samples are drawn from (temperature, top-k, top-p): the RL
        losses compute the trainer's logprobs of it, as the servers lit-rl starts report the
        sampler's (`processed_logprobs`). Temperature 0 is greedy: vLLM then reports the raw ones."""
        if self.temperature == 0:
            return RAW
        return SamplingProcess(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def _teacher_top_k(self) -> int:
        """The teacher's top-k tokens per position, when the policy's samples are scored by a teacher
        server and the module trains a dense divergence on them; 0 otherwise."""
        if not self.has_teacher:
            return 0
        return int(getattr(self.trainer.lightning_module, "served_teacher_top_k", 0))

    def _num_steps(self) -> int | None:
        steps = self.trainer.max_steps if self.trainer is not None else -1
        return steps if steps is not None and steps > 0 else None

    def _num_batches(self) -> int | None:
        steps = self._num_steps()
        return None if steps is None else -(-steps // self.updates_per_batch)

    # ---- the rollouts (rank 0) ------------------------------------------------------------------
    def _start_rollouts(self) -> None:
        """The rollout buffer on its own thread, sampling through the runtime's clients of the
        source's server (scored by the teacher's when the run has one and the policy samples)."""
        runtime, root = self.runtime, Path(self.trainer.default_root_dir)
        trust = bool(getattr(self.trainer.lightning_module, "trust_remote_code", False))
        tokenizer = load_tokenizer(self.resolve_tokenizer(), trust_remote_code=trust)  # built-in names too
        teacher_scores = self.has_teacher
        teacher_top_k = self._teacher_top_k()
        filters = [GibberishFilter(enforce="gibberish" in self.enforce_filters),
                   RepetitionFilter(enforce="repetition" in self.enforce_filters)]
        buffer = RolloutBuffer(
            self.env, runtime.client_factory(self.source, tokenizer=tokenizer), tokenizer,
            TrainSampling(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k),
            **self._scheduler_options(), num_retries=self.num_retries, on_failure=self.on_failure, scale=self.scale,
            max_consecutive_failures=self.max_consecutive_failures,
            skip_zero_advantage=self.skip_zero_advantage, filters=filters,
            requests_per_minute=self.requests_per_minute, seed=self.task_order_seed,
            chat_template_kwargs=self.chat_template_kwargs,
            teacher=runtime.client_factory("teacher", tokenizer=tokenizer) if teacher_scores else None,
            teacher_top_k=teacher_top_k,
            source=self.source,
            servers=runtime.restarts,  # restarts a server lit-rl started that died; its rollouts are made again
        )
        if self._saved_state is not None:
            buffer.load_state_dict(self._saved_state)
        else:  # a fresh run: the traces of an earlier run in this directory describe other weights
            for old in (root / "rollouts").glob("trained*.jsonl"):
                old.unlink(missing_ok=True)
        self.rollouts = ThreadedRolloutBuffer(buffer)
        if self.source == "policy":
            self.rollouts.set_version(runtime.policy_version)
            runtime.on_sync(self.rollouts.set_version)  # new rollouts are stamped with the version served
        runtime.before_stop(self.close_rollouts)
        self.rollouts.start()

    def close_rollouts(self) -> None:
        """Stop the rollouts (requests in flight aborted) and keep their state for `state_dict`:
        in-flight tasks are drawn again on resume, so none is lost. Idempotent."""
        rollouts, self.rollouts = self.rollouts, None
        if rollouts is None:
            return
        try:
            self._saved_state = rollouts.state_dict()
        except Exception as e:  # the loop may be gone already; the last checkpoint has what it had
            log.warning("RolloutDataModule: could not read the rollout state before stopping: %r", e)
        rollouts.close()

    def teardown(self, stage: str | None = None) -> None:
        self.close_rollouts()

    def on_exception(self, exception: BaseException) -> None:
        self.close_rollouts()

    # ---- batches: step numbers from the loader, rollouts inside the step ---------------------------
    def train_dataloader(self):
        return torch.utils.data.DataLoader(_StepNumbers(self._num_steps()), batch_size=None, num_workers=0)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not (isinstance(batch, dict) and "rollout_step" in batch):
            return batch
        return self._draw_step()

    @property
    def task_order_seed(self) -> int:
        """`seed`, else the one a resumed run started with, else the run's seed (so that two
        seeds of a run draw their tasks in two orders): `lit_rl.run_seed.order_seed`."""
        saved = (self._saved_state or {}).get("seed")
        saved = saved if isinstance(saved, int) and not isinstance(saved, bool) else None
        return order_seed(self.seed, saved, flag="data.seed")

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps each batch feeds: the module's `updates_per_batch` (GRPO), else 1."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        return int(getattr(module, "updates_per_batch", 1))

    def _draw_step(self) -> dict:
        """Collective under several ranks: rank 0 draws the batch, every rank takes its share.
        With several updates per batch, only a batch's first step draws; the later ones train
        the held one again (`lit_rl.data.held_batch`)."""
        trainer = self.trainer
        wait_start = time.perf_counter()
        if not self._traces_rewound:  # the first step of this run, resumed from a checkpoint that did not say its step
            if trainer.global_step > 0:  # resumed (a fresh run's old traces are removed by `_start_rollouts`)
                self._rewind_traces(trainer.global_step)
            self._traces_rewound = True
        update = trainer.global_step % self.updates_per_batch
        first_step = trainer.global_step - update
        held = self._held
        if held is None or held.first_step != first_step:
            if update:
                raise RuntimeError(f"step {trainer.global_step} is update {update} of the batch drawn at step "
                                   f"{first_step}, which this run does not hold (a checkpoint from before "
                                   "updates_per_batch was set?)")
            held = self._held = HeldBatch(first_step, self._draw_payload(first_step))
        payload = held.payload
        samples = payload["samples"]
        step = held.step
        if step is None:
            step = self._build_step(samples, payload)
            if self.updates_per_batch > 1:  # kept, with a slot per micro-batch for the old logprobs
                step = held.hold(step, trainer.global_rank, trainer.world_size)
        stats = {**step["stats"], **rollout_stats(samples, payload["staleness"]),
                 "data_wait_s": time.perf_counter() - wait_start}
        step = {**step, "stats": stats, "metrics": payload["metrics"]}
        if not update and self.progress_every and trainer.global_step % self.progress_every == 0:
            rank_zero_info(f"step {trainer.global_step}: {payload['progress']}")
        return step

    def _draw_payload(self, first_step: int) -> dict:
        """The next batch on every rank (rank 0 draws it and broadcasts it as plain data), its
        trace written; checked to be the batch this step trains."""
        trainer = self.trainer
        payload, failed = None, None
        if trainer.is_global_zero:
            try:
                payload = self._rank_zero_payload(first_step)
            except Exception as e:  # under several ranks every rank fails with it, and they save together
                if trainer.world_size == 1:
                    raise
                failed, payload = e, {"error": stopping.failure_cause(f"waiting for the batch of step {first_step}", e)}
        if trainer.world_size > 1:  # plain data across ranks, samples as dicts
            payload = from_wire(trainer.strategy.broadcast(to_wire(payload) if payload is not None else None, src=0))
        if "error" in payload:
            raise stopping.RunFailed(payload["error"]) from failed
        if payload.get("stop"):  # every rank abandons the step before training any of it
            raise stopping.stop(trainer, f"step {trainer.global_step} abandoned while waiting for its batch")
        if trainer.world_size > 1:
            mine = rank_share(payload["samples"], trainer.global_rank, trainer.world_size)
            trace_share(self._root(), first_step, trainer.global_rank, mine)
        return payload

    def _rank_zero_payload(self, first_step: int) -> dict:
        """Rank 0: the step's batch (its trace written), or a stop. The checkpoint of a failure or a stop
        must describe a state a resume can go on from: the replay rows are taken first and given back
        (their position restored) when no batch comes or taking them fails (a bad row), and once the
        rollout batch is popped the payload is held (`_held`, saved as `held_batch`) before anything
        else that can fail, such as writing its trace. Before, an error after the pop left a checkpoint
        whose buffer had moved past a batch it did not hold: that batch was lost and the resume refused
        ("drew rollout batch k+1, which belongs to step k+1")."""
        position = self.mix.state_dict()
        try:
            replay = self.mix.take()
            batch = self._wait_for_batch()
        except BaseException:
            self.mix.load_state_dict(position)
            raise
        if batch is None:
            self.mix.load_state_dict(position)  # the stop trains nothing of this step
            return {"stop": True}
        if batch.first_step != first_step:
            raise RuntimeError(f"step {first_step} drew rollout batch {batch.index}, which belongs to step "
                               f"{batch.first_step}: the rollouts' state and the trainer's step disagree")
        payload = {"samples": list(batch), "staleness": list(batch.staleness), "replay": replay,
                   "metrics": self.rollouts.metrics(), "progress": self.rollouts.progress()}
        self._held = HeldBatch(first_step, payload)
        trace_batch(self._root(), first_step, batch, replay)
        return payload

    def _build_step(self, samples: list, payload: dict) -> dict:
        """This rank's share of a batch as a step of micro-batches."""
        trainer = self.trainer
        mine = rank_share(samples, trainer.global_rank, trainer.world_size)
        layout = dict(micro_batch_tokens=self.micro_batch_tokens, packing=self.packing, pack_length=self.pack_length)
        if self.mix.split:  # each source packed apart, micro-batches tagged with the loss they feed
            parts = [(part, mine if i == 0 else rank_share(payload["replay"][part.name], trainer.global_rank,
                                                        trainer.world_size))
                     for i, (part, _) in enumerate(self.mix.split)]
            step = build_mixed_step(parts, **layout)
        else:
            step = build_step(mine, **layout)
        return step

    def _wait_for_batch(self):
        """Rank 0: the step's batch, or None when a stop was asked for while waiting (the batch
        then stays in the buffer, and errors of servers that go down with the job are that stop)."""
        trainer = self.trainer
        with stopping.stops_on_request(trainer, "waiting for the batch"):
            if self.rollouts is None:  # the first draw starts them, on the servers the runtime started
                self._start_rollouts()
            try:
                batch = self.rollouts.next_batch(timeout=self.batch_timeout,
                                                 interrupt=lambda: stopping.requested(trainer))
            except Interrupted:
                return None
        if batch is None:
            raise RuntimeError("RolloutDataModule: the rollouts ended before training did")
        return batch

    def _root(self) -> Path:
        return Path(self.trainer.default_root_dir)

    # ---- resume ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {}
        if self.rollouts is not None:
            state["buffer"] = self.rollouts.state_dict()
        elif self._saved_state is not None:
            state["buffer"] = self._saved_state
        if self.mix.state_dict():
            state["replay"] = self.mix.state_dict()
        trainer, held = self.trainer, self._held
        # A batch drawn from the buffer (whose state has moved past it) and not yet fully trained:
        # saved between two of its updates, or by a step that failed after drawing it, which a
        # resume trains again. At its first update nothing of the trust region is kept yet.
        if held is not None and trainer is not None and held.first_step <= trainer.global_step < (
                held.first_step + self.updates_per_batch):
            state["held_batch"] = held.state_dict(trainer.world_size, keep_old=trainer.global_step > held.first_step)
        if trainer is not None:
            state["step"] = trainer.global_step  # where a resume rewinds the traces to (`load_state_dict`)
        return state

    def load_state_dict(self, state: dict) -> None:
        self._saved_state = state.get("buffer")
        if self._saved_state is not None and self.trainer is not None:  # before the first draw starts the rollouts
            if problems := self._resume_problems(self._saved_state["scheduler"]):
                raise ConfigError("RolloutDataModule: the checkpoint's rollouts cannot continue with this run's "
                                  "settings: " + "; ".join(problems) + " (resume with the settings the run started with)")
        self.mix.load_state_dict(state.get("replay"))
        self._held = HeldBatch.from_state(state["held_batch"]) if "held_batch" in state else None
        if "step" in state and self.trainer is not None:  # (older checkpoints: at the first step's draw)
            self._rewind_traces(int(state["step"]))

    def _rewind_traces(self, step: int) -> None:
        """The traces of the steps this run trains again moved aside, once, as the checkpoint is restored:
        also when it trains none (resumed at `max_steps`), where an aborted launch's steps past the
        checkpoint were left listed as trained. A held batch keeps the trace of the step that drew it."""
        if self._traces_rewound:
            return
        held_from = -1 if self._held is None else self._held.first_step + 1
        rewind_traces(self._root(), max(step, held_from), self.trainer.global_rank)
        self._traces_rewound = True

    def _scheduler_options(self) -> dict:
        """The rollout buffer's batch shape and staleness bound (its `StalenessScheduler`'s options)."""
        return dict(batch_size=self.mix.rollout_count(self.batch_size), group_size=self.group_size,
                    max_concurrency=self.max_concurrency,
                    # The teacher's samples never age; for them the bound keeps generation at most a batch
                    # ahead of training (the buffer advances its version as batches are drawn).
                    max_staleness=self.max_staleness if self.source == "policy" else 1,
                    drop_stale=self.drop_stale, num_batches=self._num_batches(), updates_per_batch=self.updates_per_batch)

    def _resume_problems(self, saved: dict) -> list[str]:
        """What of the rollouts' saved state this run's options cannot continue, by their flags."""
        scheduler = StalenessScheduler(**self._scheduler_options())
        problems = []
        for name, detail in (p.split(": ", 1) for p in scheduler.resume_problems(saved)):
            if name == "num_batches":  # a max_steps below the batches drawn: the resume ends at once, as an SFT run's
                continue
            problems.append(f"{RESUMED_FLAGS[name]}: {detail.replace('scheduler has', 'this run has')}")
            if name == "batch_size" and self.mix.split:
                problems[-1] += (f" rollout samples per step (their share of data.batch_size {self.batch_size} beside "
                                 f"the replay sources, in whole groups split evenly over the {self.trainer.world_size} "
                                 "rank(s): another number of ranks can change it)")
        return problems


#: the scheduler's saved options by the flag that sets them
RESUMED_FLAGS = {"batch_size": "data.batch_size", "group_size": "data.group_size", "max_staleness": "data.max_staleness",
                 "drop_stale": "data.drop_stale", "updates_per_batch": "model.init_args.updates_per_batch"}


class _StepNumbers(torch.utils.data.IterableDataset):
    """Placeholders, one per optimizer step: cheap to fetch ahead, swapped for rollouts in the step."""

    def __init__(self, num_steps: int | None):
        self.num_steps = num_steps

    def __iter__(self):
        step = 0
        while self.num_steps is None or step < self.num_steps:
            yield {"rollout_step": step}
            step += 1
