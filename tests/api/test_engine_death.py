"""When the engine loop dies, every client waiting on it gets an error and none hangs; /health and
new requests are 503 from then on.

The real ``Engine`` runs over a scripted runner (``tests.api.stub_engine``) that raises on the
next step once ``fail`` is set, the way a device error or a bug in a jitted step would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.runtime.engine.request import SamplingParams
from tests.api.conftest import assert_error, sse_data
from tests.api.inprocess import app_client
from tests.api.stub_engine import stub_engine

LONG = {"prompt": "hello", "max_tokens": 1500, "ignore_eos": True}


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def test_every_client_gets_an_error_when_the_loop_dies() -> None:
    engine, runner = stub_engine(max_num_seqs=4, max_model_len=2048, num_pages=512, step_s=0.005)
    async with app_client(create_app(engine)) as client:
        bodies = [LONG, LONG, {**LONG, "stream": True}, {**LONG, "stream": True}]
        bodies += [LONG, {**LONG, "stream": True}]  # these two wait: max_num_seqs is 4
        tasks = [asyncio.ensure_future(client.post("/v1/completions", json=b)) for b in bodies]
        await until(lambda: len(runner.seen) == 4 and engine.num_waiting() == 2)
        await asyncio.sleep(0.05)  # the running four are decoding and streaming
        runner.fail.set()
        responses = await asyncio.wait_for(asyncio.gather(*tasks), 5)

        # JSON clients (running or still queued): a 5xx envelope.
        for response in (responses[0], responses[1], responses[4]):
            assert_error(response, 503, code="engine_aborted")
        # Streaming clients: an error event, then [DONE]; never a normal finish. The queued one
        # had its stream opened by the abort itself, so it carries no text before the error.
        for response, had_text in (
            (responses[2], True),
            (responses[3], True),
            (responses[5], False),
        ):
            assert response.status_code == 200
            data = sse_data(response.text)
            assert data[-1] == "[DONE]"
            events = [json.loads(d) for d in data[:-1]]
            assert events[-1]["error"]["code"] == "engine_aborted"
            finishes = [c["choices"][0]["finish_reason"] for c in events[:-1] if c.get("choices")]
            assert set(finishes) <= {None} and bool(finishes) == had_text

        assert not engine.healthy() and engine.num_waiting() == 0
        assert_error(await client.get("/health"), 503, code="engine_unhealthy")
        for body in (LONG, {**LONG, "stream": True}):
            assert_error(await client.post("/v1/completions", json=body), 503)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert_error(await client.post("/v1/chat/completions", json=chat), 503)


async def test_the_engine_refuses_new_work_after_its_loop_died() -> None:
    engine, runner = stub_engine()
    engine.start()
    try:
        runner.fail.set()
        stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=4), "doomed")
        delta = await asyncio.wait_for(anext(stream), 5)
        assert delta.finish_reason is not None and delta.finish_reason.value == "abort"
        await until(lambda: not engine.healthy())
        with pytest.raises(RuntimeError, match="not running"):
            engine.generate([1, 2, 3], SamplingParams(max_tokens=4), "after")
    finally:
        engine.shutdown()
