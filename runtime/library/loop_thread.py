"""An asyncio event loop on its own thread, so synchronous code can drive the engine's async API.

The engine's request streams belong to the event loop that submitted them. A plain script has no
running loop, and a Jupyter cell runs inside one that must not be blocked or re-entered, so the
library's synchronous methods hand their coroutines to this private loop and wait for the result:

1. ``run(coro)`` starts ``coro`` as a task on the loop thread and blocks until it is done.
2. ``iterate(stream)`` pulls an async iterator one item at a time through ``run``, and closes it
   however the caller stops (finished, ``break``, an exception, garbage collection).
3. When the waiting thread is interrupted (Ctrl+C), the task is cancelled and its cleanup (an
   engine stream aborting its sequence) finishes before the interrupt propagates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
_CANCEL_TIMEOUT_S = 30.0  # how long an interrupted call waits for the cancelled task's cleanup
_END = object()  # what a stream's next item is once it is exhausted


class LoopThread:
    """A private event loop running on a daemon thread until ``close()``."""

    def __init__(self, name: str = "runtime-library-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and return its result (or raise its exception).

        Raises RuntimeError when the loop is closed or when called from the loop thread itself
        (which would wait for itself forever).
        """
        if self._closed:
            coro.close()
            raise RuntimeError("the engine is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a synchronous engine method was called from its own event loop")
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        tasks: list[asyncio.Task[T]] = []

        def start() -> None:
            task = self._loop.create_task(coro)
            tasks.append(task)
            task.add_done_callback(lambda finished: _copy_outcome(finished, result))

        def cancel() -> None:
            for task in tasks:
                task.cancel()

        self._loop.call_soon_threadsafe(start)
        try:
            return result.result()
        except BaseException:
            if not result.done():  # interrupted while waiting: cancel, let the cleanup run
                self._loop.call_soon_threadsafe(cancel)  # runs after start(): FIFO
                concurrent.futures.wait([result], timeout=_CANCEL_TIMEOUT_S)
            raise

    def iterate(self, stream: AsyncIterator[T]) -> Iterator[T]:
        """Yield ``stream``'s items; the stream is closed (``aclose``) when iteration stops."""

        async def next_item() -> Any:
            try:
                return await anext(stream)
            except StopAsyncIteration:
                return _END

        try:
            while True:
                item = self.run(next_item())
                if item is _END:
                    return
                yield item
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None and not self._closed:
                if threading.current_thread() is self._thread:
                    self._loop.create_task(aclose())
                else:
                    self.run(aclose())

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the loop and join its thread. Idempotent.

        Tasks still running get ``grace_s`` to finish (an engine that was shut down first ends
        its streams, and their callers get that error); the rest are cancelled.
        """
        if self._closed:
            return
        self._closed = True

        async def finish_pending() -> None:
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            if pending:
                _, late = await asyncio.wait(pending, timeout=grace_s)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)

        timeout = grace_s + _CANCEL_TIMEOUT_S
        asyncio.run_coroutine_threadsafe(finish_pending(), self._loop).result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=_CANCEL_TIMEOUT_S)
        self._loop.close()


def _copy_outcome(task: asyncio.Task[T], result: concurrent.futures.Future[T]) -> None:
    # A cancelled task becomes an error rather than a cancelled future: ``wait`` is not woken by
    # ``Future.cancel()``, and a caller whose call was cut short by ``close()`` should learn why.
    if task.cancelled():
        result.set_exception(RuntimeError("the engine was closed before the call finished"))
    elif task.exception() is not None:
        result.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        result.set_result(task.result())
