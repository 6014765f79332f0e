"""Calls made at the same moment go to the server as one request (lit_rl.inference.batching),
against the session's real vLLM server (tests/vllm_fixtures.py): each call gets its own
prompt's answer, the same as alone; a rejected prompt fails only its own call; a cancelled
call drops out without taking the others with it."""

from __future__ import annotations

import asyncio
import collections

import httpx
import pytest
from test_inference import LOGPROB_TOL, PROMPTS, max_diff

from lit_rl.inference.client import InferenceRequestError


def counting(client) -> collections.Counter:
    """The HTTP requests `client` sends from now on, counted by path (an httpx event hook)."""
    sent: collections.Counter = collections.Counter()

    async def hook(request: httpx.Request) -> None:
        sent[request.url.path] += 1

    client.openai = client.openai.with_options(http_client=httpx.AsyncClient(event_hooks={"request": [hook]}))
    return sent


def test_concurrent_calls_share_one_request_and_each_gets_its_own_answer(vllm_server):
    prompts = [PROMPTS[i % 4][: 3 + i] for i in range(8)]  # eight different prompts

    async def go():
        async with vllm_server.client(batch_prompts=False) as alone:
            expected = [await alone.generate(p, max_tokens=12, temperature=0.0) for p in prompts]
            scores = [await alone.score(p) for p in prompts]
        async with vllm_server.client() as client:
            sent = counting(client)
            # a new client's first calls: one look-up of the model's name, then one request
            together = await asyncio.gather(*[client.generate(p, max_tokens=12, temperature=0.0) for p in prompts])
            counts = [dict(sent)]
            scored = await asyncio.gather(*[client.score(p) for p in prompts])
            counts.append(dict(sent))
            # n samples of each prompt, and two settings at one moment: one request for each setting
            sampled = await asyncio.gather(*[client.generate(p, max_tokens=4 + i % 2, n=3) for i, p in enumerate(prompts)])
            counts.append(dict(sent))

            async def late(prompt, turns):  # rollouts that await something before they ask
                for _ in range(turns):
                    await asyncio.sleep(0)
                return await client.generate(prompt, max_tokens=4, temperature=0.0)

            staggered = await asyncio.gather(*[late(p, i % 4) for i, p in enumerate(prompts)])
            counts.append(dict(sent))
            return expected, scores, together, scored, sampled, staggered, counts

    expected, scores, together, scored, sampled, staggered, counts = asyncio.run(go())
    assert counts == [{"/v1/models": 1, "/v1/completions": n} for n in (1, 2, 4, 5)]
    for prompt, alone, batched in zip(prompts, expected, together):
        assert batched[0].prompt_ids == prompt
        assert batched[0].completion_ids == alone[0].completion_ids  # greedy: the same tokens
        assert max_diff(alone[0].logprobs, batched[0].logprobs) < LOGPROB_TOL
    for alone, batched in zip(scores, scored):
        assert max_diff(alone, batched) < LOGPROB_TOL
    for i, (prompt, answer) in enumerate(zip(prompts, sampled)):
        assert [c.prompt_ids for c in answer] == [prompt] * 3
        assert all(1 <= len(c.completion_ids) <= 4 + i % 2 for c in answer)
    for prompt, alone, answer in zip(prompts, expected, staggered):
        assert answer[0].prompt_ids == prompt and answer[0].completion_ids == alone[0].completion_ids[:4]


def test_a_rejected_prompt_fails_only_its_own_call(vllm_server):
    unknown = PROMPTS[2] + [10**6]  # a token id outside the vocabulary: vLLM answers 400

    async def go():
        async with vllm_server.client() as client:
            answers = await asyncio.gather(*[client.generate(p, max_tokens=4, ignore_eos=True)
                                             for p in (PROMPTS[0], unknown, PROMPTS[1])], return_exceptions=True)
            return answers, client._batchers["generate"].requests

    (first, rejected, last), requests = asyncio.run(go())
    assert isinstance(rejected, InferenceRequestError) and "out of vocabulary" in str(rejected)
    assert first[0].prompt_ids == PROMPTS[0] and len(first[0].completion_ids) == 4
    assert last[0].prompt_ids == PROMPTS[1] and len(last[0].completion_ids) == 4
    assert requests == 1 + 3  # the joined request, then each prompt alone


def test_a_call_cancelled_before_its_request_was_rejected_is_not_sent_again(vllm_server):
    """A rejected request is sent again prompt by prompt; before, also the prompts of the calls
    that had been cancelled meanwhile (a rollout's timeout): a whole generation for nobody."""
    unknown = PROMPTS[2] + [10**6]  # a token id outside the vocabulary: vLLM answers 400

    async def go():
        async with vllm_server.client() as client:
            await client.max_model_len()  # the model's lookup done: the next calls go straight to the batcher
            calls = [asyncio.ensure_future(client.generate(p, max_tokens=4, ignore_eos=True))
                     for p in (PROMPTS[0], unknown, PROMPTS[1])]
            while not (batcher := client._batchers.get("generate")) or not batcher.requests:
                await asyncio.sleep(0)  # until the joined request has left (a 400 takes a round trip more)
            calls[2].cancel()
            answers = await asyncio.gather(*calls, return_exceptions=True)
            return answers, batcher.requests

    (first, rejected, cancelled), requests = asyncio.run(go())
    assert isinstance(rejected, InferenceRequestError) and isinstance(cancelled, asyncio.CancelledError)
    assert first[0].prompt_ids == PROMPTS[0] and len(first[0].completion_ids) == 4
    assert requests == 1 + 2  # the joined request, then the two calls still waiting, each alone


def test_a_cancelled_call_drops_out_and_the_request_ends_when_all_are_cancelled(vllm_server):
    async def go():
        async with vllm_server.client() as client:
            calls = [asyncio.ensure_future(client.generate(p, max_tokens=24, ignore_eos=True)) for p in PROMPTS[:3]]
            await asyncio.sleep(0.05)  # the request is in flight
            calls[1].cancel()
            kept = await asyncio.gather(calls[0], calls[2])
            with pytest.raises(asyncio.CancelledError):
                await calls[1]
            batcher = client._batchers["generate"]
            # every call of a request cancelled: the request is cancelled too
            doomed = [asyncio.ensure_future(client.generate(p, max_tokens=900, ignore_eos=True)) for p in PROMPTS[:2]]
            in_flight = set()
            for _ in range(500):  # until their request is sent (900 tokens: it is still running when cancelled)
                await asyncio.sleep(0.01)
                if in_flight := {task for task in batcher._in_flight if not task.done()}:
                    break
            for call in doomed:
                call.cancel()
            await asyncio.gather(*doomed, return_exceptions=True)
            # the request's task ends as its cancellation unwinds the HTTP call: under the suite's load
            # that took longer than a fixed 0.05 s once; up to 10 s, then it is read
            for _ in range(200):
                if all(task.done() for task in in_flight):
                    break
                await asyncio.sleep(0.05)
            # read here, while the loop runs: once it closes, asyncio.run cancels whatever is left
            return kept, len(in_flight), [task.cancelled() for task in in_flight], len(batcher._in_flight)

    kept, requests, cancelled, left = asyncio.run(go())
    assert [k[0].prompt_ids for k in kept] == [PROMPTS[0], PROMPTS[2]]
    assert all(len(k[0].completion_ids) == 24 for k in kept)
    assert requests == 1 and cancelled == [True] and left == 0
