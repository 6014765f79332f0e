"""ThreadedRolloutBuffer: a RolloutBuffer on its own event loop, driven from synchronous code.

Lightning's training loop is synchronous, while rollouts are asyncio. Rather than an event
loop per call (the openai client's connections belong to the loop that opened them) or locks
around shared state, ONE event loop runs in a daemon thread started here and owns the buffer
and its inference client; every method below hands a coroutine to that loop with
`asyncio.run_coroutine_threadsafe` and blocks for its result. The buffer's state is only
ever touched from its loop, so it needs no locks.

    rollouts = ThreadedRolloutBuffer(RolloutBuffer(env, lambda: server.client(), ...))
    for step in range(n):
        batch = rollouts.next_batch(timeout=600)       # raises the buffer's error, if any
        train(batch)
        rollouts.run(lambda client: client.reload_weights(step_dir))
        rollouts.set_version(step + 1)
    rollouts.close()

`close()` cancels the rollouts in flight, closes the client (its connections belong to this
loop, so it cannot outlive it) and joins the thread; it is idempotent and also runs at
interpreter exit, so a forgotten facade does not hang or spill "Task was destroyed but it
is pending" warnings.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from lit_rl.rollouts.buffer import RolloutBuffer
from lit_rl.rollouts.scheduler import Batch

log = logging.getLogger(__name__)

_GRACE = 30.0  # extra seconds the calling thread waits beyond a loop-side timeout


class Interrupted(Exception):
    """A blocking call gave up because its `interrupt()` became true; nothing was lost."""


class _WaitExpired(Exception):
    """One slice of an interruptible wait ended without a batch."""


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The daemon thread: run the loop until `close()` stops it, then finish cleanly."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


class ThreadedRolloutBuffer:
    def __init__(self, buffer: RolloutBuffer, *, name: str = "lit-rl-rollouts") -> None:
        """
        Args:
            buffer: a buffer not yet started (give it a client factory, so the client is
                made on this loop; a client made elsewhere also works if it was never used).
            name: the event loop thread's name.
        """
        self.buffer = buffer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_run_loop, args=(self._loop,), name=name, daemon=True)
        self._closed = False
        self._lock = threading.Lock()
        self._thread.start()
        atexit.register(self._close_at_exit)  # holds the facade until close(), so exit always closes it

    # -- plumbing -------------------------------------------------------------------------

    def _submit(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        """Run `coro` on the loop and wait for its result (or its exception, re-raised here)."""
        if self._closed:
            coro.close()
            raise RuntimeError("ThreadedRolloutBuffer is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("ThreadedRolloutBuffer: blocking call from its own event loop thread would deadlock")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            if future.done():  # the coroutine itself raised TimeoutError
                raise
            future.cancel()
            raise TimeoutError(f"ThreadedRolloutBuffer: no answer from the rollout loop within {timeout} s") from None
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt while waiting: do not leave it running
            raise

    def _call_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a plain function of the buffer on the loop (its state belongs to the loop)."""

        async def call() -> Any:
            return fn(*args)

        return self._submit(call(), timeout=_GRACE)

    # -- what the trainer calls ------------------------------------------------------------

    def start(self) -> None:
        """Start rollouts now (otherwise the first `next_batch` does); after `load_state_dict`."""
        self._submit(self.buffer.start())

    def next_batch(self, timeout: float | None = None, interrupt: Callable[[], bool] | None = None,
                   poll: float = 0.2) -> Batch | None:
        """The next batch (None once a finite run is over). Raises the buffer's error if
        rollouts failed, and TimeoutError (with the buffer's progress line) after `timeout` s.
        `interrupt` is polled every `poll` s while waiting; once it returns True the wait ends
        with `Interrupted` and the batch stays in the buffer (popping is atomic)."""
        if interrupt is None:
            return self._next_batch(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if interrupt():
                raise Interrupted("ThreadedRolloutBuffer.next_batch: interrupted while waiting for a batch")
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return self._next_batch(poll if left is None else max(0.0, min(poll, left)), quiet=True)
            except _WaitExpired:
                if left is not None and left <= poll:
                    raise TimeoutError(f"no rollout batch within {timeout} s; {self.buffer.progress()}") from None

    def _next_batch(self, timeout: float | None, quiet: bool = False) -> Batch | None:

        async def wait() -> Batch | None:
            task = asyncio.ensure_future(self.buffer.next_batch())
            try:
                done, _ = await asyncio.wait({task}, timeout=timeout)
            except asyncio.CancelledError:  # the caller gave up (e.g. Ctrl-C): stop waiting for the batch too
                task.cancel()
                raise
            if not done:  # popping is synchronous, so a cancelled wait never loses a batch
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if task.cancelled():
                    if quiet:
                        raise _WaitExpired()
                    raise TimeoutError(f"no rollout batch within {timeout} s; {self.buffer.progress()}")
            return task.result()

        return self._submit(wait(), timeout=None if timeout is None else timeout + _GRACE)

    def __iter__(self) -> Iterator[Batch]:
        while (batch := self.next_batch()) is not None:
            yield batch

    def set_version(self, version: int) -> None:
        """The server now serves the weights after `version` optimizer steps."""
        self._call_sync(self.buffer.set_version, version)

    def run(self, coro_fn: Callable[[Any], Awaitable[Any]], timeout: float | None = None) -> Any:
        """`await coro_fn(client)` on the rollout loop with the buffer's inference client and
        return its result, e.g. ``run(lambda c: c.reload_weights(step_dir))`` between steps."""

        async def go() -> Any:
            return await coro_fn(await self.buffer.connect())

        return self._submit(go(), timeout)

    def metrics(self) -> dict[str, float]:
        return self._call_sync(self.buffer.metrics)

    def progress(self) -> str:
        return self._call_sync(self.buffer.progress)

    def state_dict(self) -> dict[str, Any]:
        return self._call_sync(self.buffer.state_dict)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call_sync(self.buffer.load_state_dict, state)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel the rollouts, close the client, stop the loop and join its thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._close_at_exit)
        if threading.current_thread() is self._thread:
            raise RuntimeError("ThreadedRolloutBuffer.close: cannot be called from its own event loop thread")
        if self._thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self.buffer.aclose(close_client=True), self._loop)
            try:
                future.result(timeout)
            except Exception as e:  # closing must not fail the caller; the loop still stops below
                log.warning("ThreadedRolloutBuffer.close: closing the buffer failed: %r", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("ThreadedRolloutBuffer.close: the rollout loop thread did not stop within %.0f s", timeout)

    def _close_at_exit(self) -> None:
        self.close(timeout=10.0)

    def __enter__(self) -> ThreadedRolloutBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
