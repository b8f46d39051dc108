"""The private event-loop thread behind the library's synchronous methods."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest

from jax_llm_runtime.runtime.library.loop_thread import LoopThread


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


def test_run_returns_results_and_raises_errors_on_another_thread(loop_thread: LoopThread) -> None:
    async def where() -> str:
        await asyncio.sleep(0)
        return threading.current_thread().name

    assert loop_thread.run(where()) == "runtime-library-loop"

    async def fail() -> None:
        raise ValueError("bad prompt")

    with pytest.raises(ValueError, match="bad prompt"):
        loop_thread.run(fail())


def test_iterate_yields_items_and_closes_the_stream_when_left_early(
    loop_thread: LoopThread,
) -> None:
    closed: list[bool] = []

    async def numbers() -> AsyncIterator[int]:
        try:
            for i in range(100):
                yield i
        finally:
            closed.append(True)

    assert list(loop_thread.iterate(numbers())) == list(range(100))
    assert closed == [True]
    for i in loop_thread.iterate(numbers()):
        if i == 2:
            break
    assert closed == [True, True]


def test_calls_from_the_loop_thread_itself_are_refused(loop_thread: LoopThread) -> None:
    async def nested() -> None:
        loop_thread.run(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="its own event loop"):
        loop_thread.run(nested())


def test_close_gives_running_calls_a_grace_period_then_cancels_them() -> None:
    loop_thread = LoopThread()
    outcome: list[BaseException] = []
    started = threading.Event()

    async def sleep_forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    def wait_forever() -> None:
        try:
            loop_thread.run(sleep_forever())
        except RuntimeError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=wait_forever)
    caller.start()
    assert started.wait(timeout=10)
    loop_thread.close(grace_s=0.1)
    caller.join(timeout=10)
    assert len(outcome) == 1 and "closed before the call finished" in str(outcome[0])
    with pytest.raises(RuntimeError, match="closed"):
        loop_thread.run(asyncio.sleep(0))
    loop_thread.close()  # idempotent
