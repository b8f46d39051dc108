"""Graceful shutdown inside the app (``api.service.draining``): new requests refused, /health 503, those
in flight finish or, past the timeout, end with an error; the engine is shut down once.

``tests/e2e/test_sigterm.py`` sends the real signal to a ``runtime-serve`` process.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.service.draining import Drain
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import assert_error, sse_data
from tests.api.inprocess import app_client
from tests.api.stub_engine import stub_engine

LONG = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True}  # 10 s at 5 ms a token


def long_engine(**kw: Any) -> Any:
    """A stub engine with room for two LONG requests at once."""
    engine, _ = stub_engine(max_model_len=4096, num_pages=512, step_s=0.005, **kw)
    return engine


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def stream_events(body: str) -> list[Any]:
    """The SSE payloads, JSON-decoded, checking the stream ends with ``[DONE]``."""
    data = sse_data(body)
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


async def test_draining_refuses_new_requests_and_lets_running_ones_finish() -> None:
    engine = MockEngine(reply="y" * 30, token_delay_s=0.01)
    drain = Drain()
    async with app_client(create_app(engine, drain=drain)) as client:
        body = {"prompt": "hi", "max_tokens": 30, "ignore_eos": True}
        tasks = [
            asyncio.ensure_future(client.post("/v1/completions", json=body)),
            asyncio.ensure_future(client.post("/v1/completions", json={**body, "stream": True})),
        ]
        await until(lambda: engine.num_running == 2)
        assert drain.in_flight == 2
        drain.start()
        refused = await client.post("/v1/completions", json=body)
        assert_error(refused, 503, code="server_shutting_down")
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        assert_error(await client.get("/v1/models"), 503, code="server_shutting_down")
        assert_error(await client.get("/health"), 503, code="server_shutting_down")
        assert (await client.get("/metrics")).status_code == 200
        plain, streamed = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == "y" * 30
        events = stream_events(streamed.text)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert await drain.wait_idle(1.0) and drain.in_flight == 0
        assert engine.requests and len(engine.requests) == 2  # the refused one never arrived


@pytest.mark.parametrize("kind", ["engine", "mock"])
async def test_past_the_timeout_every_request_ends_with_an_error(kind: str) -> None:
    if kind == "engine":
        engine = long_engine(max_num_seqs=2)
    else:
        engine = MockEngine(reply="z", token_delay_s=0.005, max_num_seqs=2)
    drain = Drain()
    async with app_client(create_app(engine, drain=drain)) as client:
        bodies = [LONG, {**LONG, "stream": True}, LONG]  # the third waits for a slot
        tasks = [asyncio.ensure_future(client.post("/v1/completions", json=b)) for b in bodies]
        await until(lambda: drain.in_flight == 3)
        await asyncio.sleep(0.1)  # the first two are generating
        t0 = time.monotonic()
        assert await drain.run(engine, timeout_s=0.3) is False
        plain, streamed, waiting = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert time.monotonic() - t0 < 3
        assert not engine.healthy()
    for response in (plain, waiting):
        assert_error(response, 503, code="engine_aborted")
    assert streamed.status_code == 200
    events = stream_events(streamed.text)
    assert events[-1]["error"]["code"] == "engine_aborted"
    assert all(c["choices"][0]["finish_reason"] is None for c in events[:-1] if c.get("choices"))
    assert len(events) > 2  # it had streamed text before the abort


async def test_drain_returns_at_once_when_nothing_is_in_flight() -> None:
    engine, _ = stub_engine()
    drain = Drain()
    async with app_client(create_app(engine, drain=drain)) as client:
        assert (
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        ).is_success
        t0 = time.monotonic()
        assert await drain.run(engine, timeout_s=30) is True
        assert time.monotonic() - t0 < 1
        assert engine.healthy()  # shutting the engine down is left to the lifespan
    assert not engine.healthy()


async def test_stop_waiting_ends_the_drain_early() -> None:
    engine = long_engine()
    drain = Drain()
    async with app_client(create_app(engine, drain=drain)) as client:
        task = asyncio.ensure_future(client.post("/v1/completions", json=LONG))
        await until(lambda: drain.in_flight == 1)
        run = asyncio.ensure_future(drain.run(engine, timeout_s=60))
        await asyncio.sleep(0.2)
        assert not run.done()
        drain.stop_waiting()
        assert await asyncio.wait_for(run, 5) is False
        assert_error(await asyncio.wait_for(task, 5), 503, code="engine_aborted")


class CountingShutdown:
    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def shutdown(self) -> None:
        with self.lock:
            self.calls += 1
        time.sleep(0.05)


async def test_the_engine_is_shut_down_once_however_many_ask() -> None:
    engine = CountingShutdown()
    drain = Drain()
    await asyncio.gather(*(drain.shutdown_engine(engine) for _ in range(3)))  # type: ignore[arg-type]
    await drain.shutdown_engine(engine)  # type: ignore[arg-type]
    assert engine.calls == 1
