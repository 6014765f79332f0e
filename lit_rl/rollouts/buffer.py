"""RolloutBuffer: runs environment rollouts concurrently and hands out scored batches.

The asyncio shell around `StalenessScheduler` (which decides what may start and which batch
each finished group joins). The buffer draws tasks in a seeded shuffled order, runs
`env.rollout(task, ctx)` as asyncio tasks (at most `max_concurrency` samples in flight),
retries failures with exponential backoff, stamps every sample with the policy version the
scheduler recorded at spawn (never the client's cached version: a reload may land while a
rollout runs), applies the rollout filters, and computes group-relative advantages when a
batch is popped (the `"batch"` scale needs the whole batch).

    async with RolloutBuffer(env, client, tokenizer, batch_size=8, group_size=4,
                             max_concurrency=32, num_batches=10) as buffer:
        async for batch in buffer:          # Batch: a list of Samples, .index, .staleness
            ...                             # a trainer calls buffer.set_version(batch.index + 1)

Failures never hang the consumer: a rollout that raises is retried `num_retries` times and
then rejected (counted; a replacement task is spawned) or, with `on_failure="raise"`, its
error is raised from `next_batch`. An `InferenceServerError` (server unreachable or dead
after the client's own bounded retries) is fatal after the buffer's retries whatever
`on_failure` says, and `max_consecutive_failures` rejections in a row are fatal too, so a
dead server or a broken environment surfaces within (num_retries + 1) client retry chains
plus the backoff. An environment that breaks its contract (wrong group size, a sample
without a reward) is fatal at once: retrying a bug does not fix it.

One file, over the usual 400 lines, because it is one state machine: spawning, retries, teacher
scoring, acceptance, metrics and `state_dict` all read and write the same in-flight bookkeeping
(`_running`, `_respawn`, the scheduler), and splitting them would spread its invariants (no task
lost, none trained twice) over several files.

Resume: `state_dict()` is plain JSON-able data (no pickle): the scheduler state with the
finished-but-unpopped groups' samples as dicts, the task cursor, and the tasks in flight at
save time, which a loaded buffer spawns again first, so no task is skipped and no accepted
sample is trained twice. Samples carry ``metadata["task_index"]`` (position in
`env.tasks()`), ``metadata["draw"]`` (how many tasks were drawn before it in the run) and
``metadata["member"]`` (its place in the group), so ``(draw, member)`` names a sample in the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from lit_rl.data.samples import SAMPLERS, Sample, SampleGroup
from lit_rl.inference.client import InferenceClient, InferenceServerError
from lit_rl.rollouts.advantages import SCALES, Scale, all_equal, with_group_advantages
from lit_rl.rollouts.context import RolloutContext, TrainSampling
from lit_rl.rollouts.filters import RolloutFilter, apply_filters, default_filters
from lit_rl.rollouts.scheduler import Batch, StalenessScheduler, scheduler_option_problems

log = logging.getLogger(__name__)

STATE_FORMAT = 1
ON_FAILURE = ("reject", "raise")


class RolloutError(RuntimeError):
    """Rollouts cannot go on: the inference server failed, a rollout failed with
    `on_failure="raise"`, too many failed in a row, or an environment broke its contract.
    The original exception is the `__cause__`."""


class _ContractError(Exception):
    """An environment returned something the buffer cannot train on (not retried)."""


class TeacherServerError(InferenceServerError):
    """The teacher's server failed while scoring a group (as opposed to the server sampled from)."""


class ServerRecovery(Protocol):
    """Restarts dead servers (a run's `lit_rl.inference.restarts.ServerRestarts`): `generation(role)`
    counts the restarts of the role's server; `recover(role, seen, error)` (blocking) returns True
    when the server was restarted since generation `seen`, False when the error stands, and raises
    when the server is gone for good."""

    def generation(self, role: str) -> int: ...

    def recover(self, role: str, seen: int, error: BaseException | None = None) -> bool: ...


def _server_error(error: BaseException | None) -> InferenceServerError | None:
    """The InferenceServerError in an exception's cause/context chain, if any (an environment
    may wrap the client's error in its own)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, InferenceServerError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def sample_to_dict(sample: Sample) -> dict:
    """A Sample as plain JSON-able data (its metadata must be JSON-able too)."""
    return dataclasses.asdict(sample)


def sample_from_dict(data: dict) -> Sample:
    return Sample(**data)


def rollout_option_problems(*, batch_size, group_size, max_concurrency, max_staleness, num_batches=None,
                            updates_per_batch=1, num_retries=2, retry_backoff=1.0, on_failure="reject",
                            max_consecutive_failures=16, rollout_timeout=None, scale="group",
                            requests_per_minute=None, seed=0) -> list[str]:
    """What is wrong with a buffer's plain options, each problem starting with the option's name:
    `RolloutBuffer` raises them, and `RolloutDataModule` reports them (as `data.<name>`) before
    any server starts."""
    problems = scheduler_option_problems(batch_size, group_size, max_concurrency, max_staleness, num_batches,
                                         updates_per_batch)
    if not _is_int(num_retries) or num_retries < 0:
        problems.append(f"num_retries must be an int >= 0, got {num_retries!r}")
    if not _is_number(retry_backoff) or retry_backoff < 0:
        problems.append(f"retry_backoff must be a number >= 0, got {retry_backoff!r}")
    if on_failure not in ON_FAILURE:
        problems.append(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
    if max_consecutive_failures is not None and (not _is_int(max_consecutive_failures) or max_consecutive_failures < 1):
        problems.append(f"max_consecutive_failures must be an int >= 1 or None, got {max_consecutive_failures!r}")
    if rollout_timeout is not None and (not _is_number(rollout_timeout) or rollout_timeout <= 0):
        problems.append(f"rollout_timeout must be a number > 0 or None, got {rollout_timeout!r}")
    if scale not in SCALES:
        problems.append(f"scale must be one of {SCALES}, got {scale!r}")
    if requests_per_minute is not None and (not _is_number(requests_per_minute) or requests_per_minute <= 0):
        problems.append(f"requests_per_minute must be a number > 0 or None, got {requests_per_minute!r}")
    if not _is_int(seed):
        problems.append(f"seed must be an int, got {seed!r}")
    return problems


class RolloutBuffer:
    def __init__(
        self,
        env: Any,
        client: InferenceClient | Callable[[], InferenceClient],
        tokenizer: Any = None,
        sampling: TrainSampling | None = None,
        *,
        batch_size: int,
        group_size: int,
        max_concurrency: int | None = None,
        max_staleness: int | None = None,
        drop_stale: bool = False,
        num_batches: int | None = None,
        updates_per_batch: int = 1,
        num_retries: int = 2,
        retry_backoff: float = 1.0,
        on_failure: str = "reject",
        max_consecutive_failures: int | None = 16,
        rollout_timeout: float | None = None,
        scale: Scale = "group",
        skip_zero_advantage: bool = False,
        filters: Sequence[RolloutFilter] | None = None,
        requests_per_minute: float | None = None,
        seed: int = 0,
        chat_template_kwargs: dict | None = None,
        teacher: InferenceClient | Callable[[], InferenceClient] | None = None,
        teacher_top_k: int = 0,
        source: str = "policy",
        servers: ServerRecovery | None = None,
    ) -> None:
        """
        Args:
            env: an `Environment` (`tasks()` and `async rollout(task, ctx) -> SampleGroup`).
            client: an `InferenceClient`, or a no-argument factory returning one. A client
                made by a factory is created on the buffer's event loop and closed by
                `aclose()`; a client passed in is the caller's to close.
            tokenizer: the policy's tokenizer for `RolloutContext`; None asks the client.
            sampling: training sampling settings (temperature 1, no seed by default).
            batch_size: samples per batch (= per optimizer step), a multiple of group_size.
            group_size: samples per task (completions of one prompt).
            max_concurrency: samples in flight at most; None means batch_size.
            max_staleness: optimizer steps a sample may lag the policy that trains on it;
                None: unbounded (a standalone collector never has to call `set_version`).
            drop_stale: drop groups that finish too old (True) or throttle spawning (False).
            num_batches: batches in the run; None: endless.
            updates_per_batch: optimizer steps each batch feeds (versions and staleness stay
                in optimizer steps; `lit_rl.rollouts.scheduler`).
            num_retries: retries of a failed rollout (so num_retries + 1 attempts).
            retry_backoff: seconds before the first retry; doubled for each next one.
            on_failure: "reject" (count the task, spawn another) or "raise" (the error is
                raised from `next_batch`) once a rollout's retries are spent.
            max_consecutive_failures: this many rejected rollouts in a row (no success in
                between) is fatal; None never gives up.
            rollout_timeout: seconds one rollout attempt may take (then it is a failure);
                None: only the client's own timeouts apply.
            scale: advantage scale, "group", "batch" or "none" (`lit_rl.rollouts.advantages`).
            skip_zero_advantage: reject (and count) a group whose rewards are all equal. Fatal when
                `max_consecutive_failures` batches' worth of groups in a row are skipped (verl's
                `max_num_gen_batches`): every task then scores the same, and the batch would never fill.
            filters: rollout filters (`lit_rl.rollouts.filters`); None: gibberish and
                repetition, measured but not enforced; () for none.
            requests_per_minute: start at most this many rollout attempts per minute (for
                rate-limited endpoints; one attempt may send several requests).
            seed: seed of the task order (a fresh shuffle of `env.tasks()` every epoch).
            chat_template_kwargs: passed to the chat template by rollouts (e.g. enable_thinking).
            teacher: a client of a frozen teacher's server (or a factory, as for `client`):
                every accepted group is scored by it as part of its rollout (one prefill per
                sample, concurrently), filling each sample's `teacher_logprobs` on its
                trained tokens (on-policy distillation). None: no teacher.
            teacher_top_k: also fill each sample's `teacher_topk_ids` / `teacher_topk_logprobs`:
                the teacher's k most likely next tokens at each trained position, from the same
                prefill (dense distillation from a teacher server). 0: the sampled tokens only.
            source: who `client` samples from: "policy" (the model being trained) or "teacher" (a frozen
                teacher whose completions are SFT data): then every sample's `source` is
                "teacher", its sampling logprobs move to `teacher_logprobs` and `logprobs` is
                None (they are not the policy's: no staleness, exempt from logprob filters);
                the version advances as batches are drawn, so `max_staleness` bounds how many
                batches generation runs ahead of the consumer (it would race ahead unbounded).
            servers: who restarts the servers when one dies (a training run's `InferenceRuntime.restarts`):
                an attempt that fails with a server error asks it to `recover` that server, and
                if the server was restarted since the attempt began, the attempt is made again
                from the start, not counted as a retry (its partial result discarded); a server
                that is gone for good is fatal at once. None: server errors are retried and
                then fatal, as above.
        """
        max_concurrency = batch_size if max_concurrency is None else max_concurrency
        filters = default_filters() if filters is None else tuple(filters)
        problems = rollout_option_problems(
            batch_size=batch_size, group_size=group_size, max_concurrency=max_concurrency, max_staleness=max_staleness,
            num_batches=num_batches, updates_per_batch=updates_per_batch, num_retries=num_retries,
            retry_backoff=retry_backoff, on_failure=on_failure, max_consecutive_failures=max_consecutive_failures,
            rollout_timeout=rollout_timeout, scale=scale, requests_per_minute=requests_per_minute, seed=seed)
        if not problems:
            self._scheduler = StalenessScheduler(
                batch_size, group_size, max_concurrency, max_staleness, drop_stale=drop_stale, num_batches=num_batches,
                updates_per_batch=updates_per_batch,
            )
        if not callable(getattr(env, "rollout", None)) or not callable(getattr(env, "tasks", None)):
            problems.append(f"env must have tasks() and async rollout(task, ctx), got {type(env).__name__}")
        if client is None:
            problems.append("client must be an InferenceClient or a factory returning one, got None")
        if sampling is not None and not isinstance(sampling, TrainSampling):
            problems.append(f"sampling must be a TrainSampling, got {type(sampling).__name__}")
        if source not in SAMPLERS:
            problems.append(f"source must be one of {SAMPLERS}, got {source!r}")
        if not _is_int(teacher_top_k) or teacher_top_k < 0 or (teacher_top_k and teacher is None):
            problems.append(f"teacher_top_k must be an int >= 0, and > 0 only with a teacher, got {teacher_top_k!r}")
        if source == "teacher" and teacher is not None:
            problems.append("source 'teacher' samples from the teacher itself; give no separate teacher to score them")
        for f in filters:
            if not callable(getattr(f, "check", None)) or not isinstance(getattr(f, "name", None), str):
                problems.append(f"filters must have a name and check(sample), got {f!r}")
        names = [getattr(f, "name", None) for f in filters]
        if len(set(names)) != len(names):
            problems.append(f"filter names must be unique, got {names}")
        if problems:
            raise ValueError("RolloutBuffer: " + "; ".join(problems))

        self.env = env
        self.env_name = str(getattr(env, "name", None) or type(env).__name__)
        self._client_factory = None if hasattr(client, "generate") else client
        self._client = client if self._client_factory is None else None
        self._teacher_factory = teacher if teacher is not None and not hasattr(teacher, "score") else None
        self._teacher = teacher if self._teacher_factory is None else None
        self.teacher_top_k = teacher_top_k
        self.tokenizer = tokenizer
        self.sampling = sampling or TrainSampling()
        self.batch_size, self.group_size = batch_size, group_size
        self.num_retries, self.retry_backoff, self.on_failure = num_retries, float(retry_backoff), on_failure
        self.max_consecutive_failures, self.rollout_timeout = max_consecutive_failures, rollout_timeout
        self.scale, self.skip_zero_advantage, self.filters = scale, skip_zero_advantage, filters
        self.requests_per_minute, self.seed = requests_per_minute, seed
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.source = source
        self.servers = servers

        self._tasks_list: list[dict] | None = None
        self._perm: tuple[int, list[int]] | None = None  # (epoch, shuffled task indices)
        self._cursor = 0  # tasks drawn so far (the next draw number)
        self._respawn: deque[tuple[int, int]] = deque()  # (draw, task index) to spawn before new draws
        self._running: dict[int, tuple[int, int]] = {}  # scheduler task id -> (draw, task index)
        self._aio: dict[int, asyncio.Task] = {}  # scheduler task id -> its asyncio task
        self._changed: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._started = self._closed = False
        self._next_start = 0.0  # pacing: loop time of the next allowed rollout start
        self._consecutive_failures = 0
        self._consecutive_skips = 0
        self._started_at = 0.0
        self._session_tokens = 0  # completion tokens generated since start (for tokens/s)
        self.counters = {"failed": 0, "skipped_zero_advantage": 0, "filtered": 0, "retries": 0, "reissued": 0,
                         "completion_tokens": 0, **{f"flagged_{name}": 0 for name in names}}
        self._last: dict[str, float] = {}  # metrics of the last popped batch
        self._teacher_s = 0.0  # seconds spent in teacher scoring, over scored groups
        self._teacher_groups = 0

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The inference client (None until `connect()` when it comes from a factory)."""
        return self._client

    @property
    def scheduler(self) -> StalenessScheduler:
        return self._scheduler

    async def connect(self) -> Any:
        """Create the client (from the factory) and the tokenizer if needed; returns the client."""
        if self._client is None:
            self._client = self._client_factory()
        if self._teacher is None and self._teacher_factory is not None:
            self._teacher = self._teacher_factory()
        if self._teacher is not None and (context := await self._teacher.max_model_len()) is not None:
            # the teacher's prefill of a sample must leave room for the one token it generates
            self._client.cap_context(context - 1, f"the teacher server's max_model_len {context}, less the token its "
                                                  "scoring request generates")
        if self.tokenizer is None:
            self.tokenizer = await self._client.tokenizer()
        return self._client

    async def start(self) -> None:
        """Start rollouts (idempotent; `next_batch` calls it). Call on the loop that will run them."""
        if self._closed:
            raise RuntimeError("RolloutBuffer is closed")
        if self._started:
            return
        self._changed = asyncio.Event()
        await self.connect()
        self._env_tasks()
        self._started, self._started_at = True, time.monotonic()
        self._fill()

    async def aclose(self, close_client: bool | None = None) -> None:
        """Cancel every rollout in flight and wait until they are gone (idempotent). Closes the
        client when the buffer made it (or when `close_client` is True). The tasks that were in
        flight stay in `state_dict()` as pending: a resumed buffer runs them again."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._aio.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if (self._client_factory is not None if close_client is None else close_client) and self._client is not None:
            await self._client.aclose()
        if self._teacher_factory is not None and self._teacher is not None:
            await self._teacher.aclose()
        self._wake()

    async def __aenter__(self) -> RolloutBuffer:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # -- the consumer side ----------------------------------------------------------------

    async def next_batch(self) -> Batch | None:
        """The next batch (a `Batch`: samples in group order with `advantages` filled, plus
        `.index`, `.versions`, `.staleness`), waiting for rollouts as needed; None once a
        finite run is over. Raises `RolloutError` when rollouts failed for good, and
        RuntimeError when no batch can ever come because the policy version lags (call
        `set_version` after each optimizer step when `max_staleness` is set)."""
        await self.start()
        while True:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise RuntimeError("RolloutBuffer is closed")
            batch = self._scheduler.pop_batch()
            if batch is not None:
                if self.source == "teacher":  # no policy versions: each drawn batch lets the next start
                    self._scheduler.set_version(self._scheduler.first_step(batch.index + 1))
                batch = self._finish(batch)
                self._fill()
                return batch
            if self._scheduler.finished:
                return None
            self._fill()
            if self._scheduler.in_flight_samples == 0 and self._scheduler.num_to_spawn() == 0:
                s = self._scheduler
                raise RuntimeError(
                    f"RolloutBuffer: batch {s.next_batch} can never be filled: nothing is in flight and the "
                    f"scheduler may start nothing at policy version {s.version} with max_staleness={s.max_staleness} "
                    f"(it needs version >= {s.first_step(s.next_batch) - (s.max_staleness or 0)}); call "
                    "set_version(s + 1) after optimizer step s"
                )
            self._changed.clear()
            await self._changed.wait()

    def __aiter__(self) -> RolloutBuffer:
        return self

    async def __anext__(self) -> Batch:
        batch = await self.next_batch()
        if batch is None:
            raise StopAsyncIteration
        return batch

    def set_version(self, version: int) -> None:
        """The inference server now serves the weights after `version` optimizer steps (call
        on the buffer's loop). New rollouts are stamped with it; waiting spawns may start."""
        self._scheduler.set_version(version)
        self._fill()
        self._wake()

    # -- rollouts -------------------------------------------------------------------------

    def _env_tasks(self) -> list[dict]:
        if self._tasks_list is None:
            self._tasks_list = list(self.env.tasks())
            if not self._tasks_list:
                raise ValueError(f"RolloutBuffer: environment {self.env_name!r} has no tasks")
        return self._tasks_list

    def _task_index(self, draw: int) -> int:
        """Draw `draw` of the run: epoch draw // n, in that epoch's seeded shuffle."""
        n = len(self._env_tasks())
        epoch, position = divmod(draw, n)
        if self._perm is None or self._perm[0] != epoch:
            order = list(range(n))
            random.Random(f"lit-rl:{self.seed}:{epoch}").shuffle(order)  # str seeds are stable across processes
            self._perm = (epoch, order)
        return self._perm[1][position]

    def _fill(self) -> None:
        """Spawn every rollout the scheduler allows now."""
        if not self._started or self._closed or self._error is not None:
            return
        while self._scheduler.num_to_spawn() > 0:
            task_id = self._scheduler.spawn()
            version = self._scheduler.version  # read right after spawn: what the samples are stamped with
            if self._respawn:
                draw, index = self._respawn.popleft()
            else:
                draw, index = self._cursor, self._task_index(self._cursor)
                self._cursor += 1
            self._running[task_id] = (draw, index)
            t = asyncio.create_task(self._rollout(task_id, draw, index, version), name=f"rollout-draw-{draw}")
            self._aio[task_id] = t
            t.add_done_callback(lambda t, task_id=task_id: self._on_done(task_id, t))

    def _on_done(self, task_id: int, t: asyncio.Task) -> None:
        self._aio.pop(task_id, None)
        if not t.cancelled() and t.exception() is not None:  # a bug here, not in the env: never hang on it
            error = RolloutError(f"RolloutBuffer: internal error in a rollout task: {t.exception()!r}")
            error.__cause__ = t.exception()
            self._fatal(error)

    def _where(self, draw: int, index: int) -> str:
        try:
            task_id = self.env.task_id(self._env_tasks()[index])
        except Exception:  # only for the message: an env without task_id (or a broken one) is fine
            task_id = None
        name = f" (id {task_id!r})" if task_id is not None else ""
        return f"{self.env_name}.rollout of task {index}{name}, draw {draw}"

    async def _pace(self) -> None:
        if self.requests_per_minute is None:
            return
        now = asyncio.get_running_loop().time()
        start = max(now, self._next_start)
        self._next_start = start + 60.0 / self.requests_per_minute
        if start > now:
            await asyncio.sleep(start - now)

    async def _rollout(self, task_id: int, draw: int, index: int, version: int) -> None:
        """One task: attempts with backoff, then accept its group or give up."""
        ctx = RolloutContext(client=self._client, tokenizer=self.tokenizer, sampling=self.sampling,
                             group_size=self.group_size, policy_version=version,
                             chat_template_kwargs=dict(self.chat_template_kwargs))
        task = self._env_tasks()[index]
        error: Exception | None = None
        attempt = 0
        while attempt <= self.num_retries:
            if attempt:
                self.counters["retries"] += 1
                await asyncio.sleep(self.retry_backoff * 2 ** (attempt - 1))
            await self._pace()
            generations = self._generations()
            try:
                samples = await asyncio.wait_for(self._attempt(task, ctx, draw, index), self.rollout_timeout)
            except _ContractError as e:
                return self._fatal(RolloutError(str(e)))
            except Exception as e:  # CancelledError is not an Exception: cancellation passes through
                log.debug("%s failed (attempt %d): %r", self._where(draw, index), attempt + 1, e)
                try:
                    if await self._server_restarted(e, generations):
                        self.counters["reissued"] += 1  # the whole rollout again, on the new server
                        continue
                except Exception as gone:
                    fatal = RolloutError(f"the inference server failed ({self._where(draw, index)}): {gone}")
                    fatal.__cause__ = gone
                    return self._fatal(fatal)
                error = e
                attempt += 1
                continue
            return self._accept(task_id, draw, index, version, samples)
        self._give_up(task_id, draw, index, error)

    def _generations(self) -> dict[str, int]:
        """The restart count of each server this buffer uses, as an attempt begins."""
        if self.servers is None:
            return {}
        roles = {self.source} | ({"teacher"} if self._teacher is not None else set())
        return {role: self.servers.generation(role) for role in roles}

    async def _server_restarted(self, error: Exception, generations: dict[str, int]) -> bool:
        """Whether `error` came from a server that is restarted since the attempt began (asking
        `servers` to restart it if it is dead: blocking, so on a worker thread)."""
        server = _server_error(error)
        if server is None or self.servers is None:
            return False
        role = "teacher" if isinstance(server, TeacherServerError) else self.source
        if role not in generations:
            return False
        return await asyncio.get_running_loop().run_in_executor(
            None, self.servers.recover, role, generations[role], server)

    async def _attempt(self, task: dict, ctx: RolloutContext, draw: int, index: int) -> list[Sample]:
        """One attempt: the environment's rollout, its contract checked (`_ContractError`), then
        (with a teacher) its scoring."""
        samples = self._check_group(await self.env.rollout(task, ctx), draw, index)
        return samples if self._teacher is None else await self._teacher_scores(samples)

    async def _teacher_scores(self, samples: list[Sample]) -> list[Sample]:
        """The samples with `teacher_logprobs`: the teacher's logprob of each trained token (0
        elsewhere), and with `teacher_top_k` its top-k tokens there too ([0] * k elsewhere), from
        one prefill per sample, all at once."""
        start = time.monotonic()
        k = self.teacher_top_k
        try:
            scores = await asyncio.gather(*(self._teacher.score_top_k(s.input_ids, k) for s in samples))
        except InferenceServerError as e:
            raise TeacherServerError(f"the teacher server failed: {e}") from e
        self._teacher_s += time.monotonic() - start
        self._teacher_groups += 1
        scored = []
        for s, (lps, top_ids, top_lps) in zip(samples, scores):
            fields = {"teacher_logprobs": [lp if m else 0.0 for lp, m in zip(lps, s.loss_mask)]}
            if k:
                fields["teacher_topk_ids"] = [ids if m else [0] * k for ids, m in zip(top_ids, s.loss_mask)]
                fields["teacher_topk_logprobs"] = [row if m else [0.0] * k for row, m in zip(top_lps, s.loss_mask)]
            scored.append(dataclasses.replace(s, **fields))
        return scored

    def _accept(self, task_id: int, draw: int, index: int, version: int, samples: list[Sample]) -> None:
        samples = [
            dataclasses.replace(s, policy_version=version, metadata={
                **s.metadata, "task_index": index, "draw": draw, "member": member,
                "completion_tokens": s.num_targets})
            for member, s in enumerate(samples)
        ]
        if self.source == "teacher":  # the teacher's samples: SFT data, not the policy's behaviour
            samples = [dataclasses.replace(s, source="teacher", logprobs=None, teacher_logprobs=s.logprobs)
                       for s in samples]
        tokens = sum(s.num_targets for s in samples)
        self.counters["completion_tokens"] += tokens
        self._session_tokens += tokens
        result = apply_filters(samples, self.filters)
        for name, n in result.flagged.items():
            self.counters[f"flagged_{name}"] += n
        self.counters["filtered"] += result.enforced
        del self._running[task_id]
        self._consecutive_failures = 0
        if self.skip_zero_advantage and all_equal([s.reward for s in samples]):
            self._scheduler.reject(task_id)
            self.counters["skipped_zero_advantage"] += 1
            self._consecutive_skips += 1
            limit = self._skip_limit()
            if limit is not None and self._consecutive_skips >= limit:
                return self._fatal(RolloutError(
                    f"{self._consecutive_skips} groups in a row had equal rewards (the last: reward {samples[0].reward}) "
                    f"and were skipped (data.skip_zero_advantage), {self.max_consecutive_failures} batches' worth "
                    "(max_consecutive_failures): no batch can fill. Check the reward on a few completions; raise "
                    "temperature or group_size, or train without skip_zero_advantage"))
        else:
            self._consecutive_skips = 0
            self._scheduler.complete(task_id, result.samples)  # may drop it if too old (drop_stale)
        self._fill()
        self._wake()

    def _skip_limit(self) -> int | None:
        """Skipped groups in a row that end the run: `max_consecutive_failures` batches of them."""
        if self.max_consecutive_failures is None:
            return None
        return self.max_consecutive_failures * max(1, self.batch_size // self.group_size)

    def _check_group(self, group: Any, draw: int, index: int) -> list[Sample]:
        samples = group.samples if isinstance(group, SampleGroup) else group
        where = self._where(draw, index)
        if not isinstance(samples, (list, tuple)):
            raise _ContractError(f"{where} returned {type(group).__name__}; expected a SampleGroup")
        if len(samples) != self.group_size:
            raise _ContractError(f"{where} returned {len(samples)} samples; group_size is {self.group_size}")
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise _ContractError(f"{where}: sample {i} is a {type(s).__name__}, not a Sample")
            if s.reward is None or not math.isfinite(s.reward):
                raise _ContractError(f"{where}: sample {i} has reward {s.reward!r}; advantages need a finite reward")
        return list(samples)

    def _give_up(self, task_id: int, draw: int, index: int, error: Exception) -> None:
        attempts = self.num_retries + 1
        where = self._where(draw, index)
        server = _server_error(error)
        if server is not None:
            fatal = RolloutError(f"the inference server failed ({where}, {attempts} attempts): {server}")
            fatal.__cause__ = error
            return self._fatal(fatal)
        if self.on_failure == "raise":
            fatal = RolloutError(f"{where} failed after {attempts} attempts: {error!r}")
            fatal.__cause__ = error
            return self._fatal(fatal)
        del self._running[task_id]
        self._scheduler.reject(task_id)
        self.counters["failed"] += 1
        self._consecutive_failures += 1
        log.warning("%s rejected after %d attempts: %r", where, attempts, error)
        if self.max_consecutive_failures is not None and self._consecutive_failures >= self.max_consecutive_failures:
            fatal = RolloutError(f"{self._consecutive_failures} rollouts in a row failed (max_consecutive_failures); "
                                 f"the last: {where}: {error!r}")
            fatal.__cause__ = error
            return self._fatal(fatal)
        self._fill()
        self._wake()

    def _fatal(self, error: BaseException) -> None:
        """Stop: keep the first error for the consumer and cancel the other rollouts (they stay
        pending in `state_dict`, as they were never trained)."""
        if self._error is None:
            self._error = error
            log.error("RolloutBuffer: %s", error)
        current = asyncio.current_task()
        for t in self._aio.values():
            if t is not current:
                t.cancel()
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()

    # -- batches and metrics --------------------------------------------------------------

    def _finish(self, batch: Batch) -> Batch:
        samples = with_group_advantages(batch, self.group_size, self.scale)
        out = Batch(samples, index=batch.index, versions=batch.versions, first_step=batch.first_step)
        staleness = out.staleness
        lengths = [s.metadata.get("completion_tokens", s.num_targets) for s in out]
        self._last = {
            "rollout/reward_mean": sum(s.reward for s in out) / len(out),
            "rollout/staleness_mean": sum(staleness) / len(staleness),
            "rollout/staleness_max": float(max(staleness)),
            "rollout/completion_len_mean": sum(lengths) / len(lengths),
            "rollout/truncated_frac": sum(s.truncated or s.finish_reason == "length" for s in out) / len(out),
        }
        return out

    def metrics(self) -> dict[str, float]:
        """`rollout/<name>` metrics: the last popped batch's (reward_mean, staleness_mean/max,
        completion_len_mean, truncated_frac; absent before the first batch) and running ones
        (in_flight and waiting samples, counts of rejected tasks, dropped groups, groups skipped
        for zero advantage, filtered and flagged samples, retries; completion tokens/s since start)."""
        s = self._scheduler
        elapsed = time.monotonic() - self._started_at if self._started else 0.0
        return {
            **self._last,
            "rollout/batches": float(s.next_batch),
            "rollout/policy_version": float(s.version),
            "rollout/in_flight": float(s.in_flight_samples),
            "rollout/waiting": float(s.waiting_samples),
            "rollout/rejected": float(self.counters["failed"]),
            "rollout/dropped": float(s.dropped_groups),
            **{f"rollout/{k}": float(v) for k, v in self.counters.items() if k != "failed"},
            "rollout/tokens_per_s": self._session_tokens / elapsed if elapsed > 0 else 0.0,
            **({"rollout/teacher_s_per_group": self._teacher_s / max(self._teacher_groups, 1)}
               if self._teacher is not None or self._teacher_factory is not None else {}),
        }

    def progress(self) -> str:
        """One line for humans, e.g. ``rollout: batch 3 | reward 0.41 | staleness 0.5 (max 1) |
        in flight 16 waiting 4 | rejected 2 dropped 0 skipped 0 filtered 0 | 812 tok/s``."""
        m = self.metrics()
        parts = [f"rollout: batch {int(m['rollout/batches'])}"]
        if "rollout/reward_mean" in m:
            parts.append(f"reward {m['rollout/reward_mean']:.2f}")
            parts.append(f"staleness {m['rollout/staleness_mean']:.1f} (max {int(m['rollout/staleness_max'])})")
        parts.append(f"in flight {int(m['rollout/in_flight'])} waiting {int(m['rollout/waiting'])}")
        parts.append(f"rejected {int(m['rollout/rejected'])} dropped {int(m['rollout/dropped'])} "
                     f"skipped {int(m['rollout/skipped_zero_advantage'])} filtered {int(m['rollout/filtered'])}")
        parts.append(f"{m['rollout/tokens_per_s']:.0f} tok/s")
        if "rollout/teacher_s_per_group" in m:
            parts.append(f"teacher {m['rollout/teacher_s_per_group']:.2f} s/group")
        return " | ".join(parts)

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able data: the scheduler state (finished, unpopped groups with their
        samples as dicts), the task cursor, and the (draw, task index) pairs to spawn first on
        resume: the tasks in flight now plus any not yet re-spawned from an earlier resume."""
        scheduler = self._scheduler.state_dict()
        scheduler["ready"] = [[t, v, [sample_to_dict(s) for s in samples]] for t, v, samples in scheduler["ready"]]
        pending = sorted([*self._running.values(), *self._respawn])
        return {
            "format": STATE_FORMAT,
            "scheduler": scheduler,
            "seed": self.seed,
            "num_tasks": len(self._env_tasks()),
            "cursor": self._cursor,
            "pending": [[draw, index] for draw, index in pending],
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state before `start()`. Versions and batch indices continue; the
        pending tasks are spawned before any new draw."""
        if self._started:
            raise RuntimeError("RolloutBuffer.load_state_dict: call it before the buffer starts")
        problems = []
        if state.get("format") != STATE_FORMAT:
            problems.append(f"format {state.get('format')!r} is not {STATE_FORMAT}")
        if state.get("seed") != self.seed:
            problems.append(f"seed: saved {state.get('seed')!r}, buffer has {self.seed} (the task order would differ)")
        if state.get("num_tasks") != len(self._env_tasks()):
            problems.append(f"num_tasks: saved {state.get('num_tasks')!r}, {self.env_name} has {len(self._env_tasks())}")
        if problems:
            raise ValueError("RolloutBuffer.load_state_dict: state does not fit this buffer: " + "; ".join(problems))
        scheduler = dict(state["scheduler"])
        scheduler["ready"] = [[t, v, [sample_from_dict(d) for d in samples]] for t, v, samples in scheduler["ready"]]
        self._scheduler.load_state_dict(scheduler)
        self._cursor = int(state["cursor"])
        self._respawn = deque((int(d), int(i)) for d, i in state["pending"])
        self.counters.update({k: v for k, v in state["counters"].items() if k in self.counters})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
