"""Admission: a bounded waiting queue (``--max-waiting``), 503 with ``Retry-After`` beyond it,
``--max-num-seqs`` honoured, and requests that can never fit refused at once.

The engine-level tests run the real ``Engine`` over a scripted runner (``tests.api.stub_engine``);
the HTTP tests run the app over it and over the mock engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.cli.serve import _build_engine, _config_from_args, build_parser
from jax_llm_runtime.runtime.config import DEFAULT_MAX_WAITING, EngineConfig
from jax_llm_runtime.runtime.engine.interface import EngineOverloadedError
from jax_llm_runtime.runtime.engine.mock import VOCAB_SIZE, MockEngine
from jax_llm_runtime.runtime.engine.request import FinishReason, SamplingFieldError, SamplingParams
from tests.api.conftest import assert_error, sse_chunks
from tests.api.inprocess import app_client
from tests.api.stub_engine import stub_engine

PROMPT = [1, 2, 3]


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``condition`` on the event loop; fail the test when it stays false."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def drain_stream(stream: Any) -> FinishReason | None:
    reason = None
    async for delta in stream:
        reason = delta.finish_reason
    return reason


async def test_engine_refuses_past_max_waiting_and_queues_nothing() -> None:
    engine, runner = stub_engine(max_num_seqs=2, max_waiting=2)
    engine.start()
    runner.gate.clear()  # the first prefill holds the loop thread: nothing starts or finishes
    try:
        sampling = SamplingParams(max_tokens=4)
        streams = [engine.generate(PROMPT, sampling, f"r{i}") for i in range(4)]
        assert engine.num_waiting() == 2
        with pytest.raises(EngineOverloadedError) as err:
            engine.generate(PROMPT, sampling, "one-too-many")
        assert err.value.num_waiting == 2 and err.value.max_waiting == 2
        assert "overloaded" in str(err.value)
        assert engine.num_waiting() == 2  # the refused request left no trace
        runner.gate.set()
        reasons = await asyncio.wait_for(asyncio.gather(*map(drain_stream, streams)), 10)
        assert reasons == [FinishReason.LENGTH] * 4
        assert "one-too-many" not in runner.seen
        # Finished sequences give their places back: four fit again.
        again = [engine.generate(PROMPT, sampling, f"again{i}") for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*map(drain_stream, again)), 10)
    finally:
        runner.gate.set()
        engine.shutdown()


async def test_an_aborted_sequence_gives_its_place_back() -> None:
    engine, _ = stub_engine(max_num_seqs=1, max_waiting=1, step_s=0.005)
    engine.start()
    try:
        sampling = SamplingParams(max_tokens=400)
        first = engine.generate(PROMPT, sampling, "first")
        second = engine.generate(PROMPT, sampling, "second")
        with pytest.raises(EngineOverloadedError):
            engine.generate(PROMPT, sampling, "third")
        await second.aclose()  # type: ignore[attr-defined]
        await until(lambda: engine.num_waiting() == 0)
        third = engine.generate(PROMPT, SamplingParams(max_tokens=2), "third")
        await first.aclose()  # type: ignore[attr-defined]
        assert await asyncio.wait_for(drain_stream(third), 10) is FinishReason.LENGTH
    finally:
        engine.shutdown()


async def test_n_counts_every_sequence_and_an_impossible_n_is_a_field_error() -> None:
    engine, runner = stub_engine(max_num_seqs=2, max_waiting=1)
    engine.start()
    runner.gate.clear()
    try:
        with pytest.raises(SamplingFieldError) as err:
            engine.generate_n(PROMPT, SamplingParams(max_tokens=2), "too-many", 4)
        assert err.value.param == "n" and "never" in str(err.value)
        streams = engine.generate_n(PROMPT, SamplingParams(max_tokens=2), "three", 3)
        with pytest.raises(EngineOverloadedError):
            engine.generate_n(PROMPT, SamplingParams(max_tokens=2), "one-more", 1)
        runner.gate.set()
        await asyncio.wait_for(asyncio.gather(*map(drain_stream, streams)), 10)
    finally:
        runner.gate.set()
        engine.shutdown()


async def test_unbounded_when_max_waiting_is_zero() -> None:
    engine, runner = stub_engine(max_num_seqs=1, max_waiting=0)
    engine.start()
    runner.gate.clear()
    try:
        streams = [
            engine.generate(PROMPT, SamplingParams(max_tokens=1), f"r{i}") for i in range(50)
        ]
        assert engine.num_waiting() == 49
        runner.gate.set()
        await asyncio.wait_for(asyncio.gather(*map(drain_stream, streams)), 10)
    finally:
        runner.gate.set()
        engine.shutdown()


async def test_a_prompt_larger_than_the_whole_kv_cache_is_refused_at_once() -> None:
    # max_model_len above what 4 pages of 16 tokens hold (the builder caps it; a library user
    # constructing an Engine may not): such a sequence would wait for pages forever.
    engine, _ = stub_engine(num_pages=4, page_size=16, max_model_len=512)
    engine.start()
    try:
        with pytest.raises(ValueError, match="KV cache holds 64 tokens"):
            engine.generate(list(range(1, 61)), SamplingParams(max_tokens=5), "too-big")
        # Exactly the whole cache still runs to the end.
        fits = engine.generate(list(range(1, 41)), SamplingParams(max_tokens=24), "fits")
        assert await asyncio.wait_for(drain_stream(fits), 10) is FinishReason.LENGTH
    finally:
        engine.shutdown()


@pytest.mark.parametrize("token_id", [-1, VOCAB_SIZE, 2**31])
async def test_a_prompt_token_outside_the_vocabulary_is_refused_by_the_engine(token_id) -> None:
    # The HTTP layer refuses these too; a library caller reaches the engine directly.
    engine, _ = stub_engine()
    engine.start()
    try:
        with pytest.raises(ValueError, match=f"token id {token_id} is outside the vocabulary"):
            engine.generate([1, token_id, 2], SamplingParams(max_tokens=2), "bad-id")
        ok = engine.generate([1, 2], SamplingParams(max_tokens=2), "ok")
        assert await asyncio.wait_for(drain_stream(ok), 10) is FinishReason.LENGTH
    finally:
        engine.shutdown()


async def test_max_num_seqs_bounds_every_step() -> None:
    engine, runner = stub_engine(max_num_seqs=2)
    engine.start()
    try:
        streams = [engine.generate(PROMPT, SamplingParams(max_tokens=6), f"r{i}") for i in range(5)]
        reasons = await asyncio.wait_for(asyncio.gather(*map(drain_stream, streams)), 10)
        assert reasons == [FinishReason.LENGTH] * 5
        assert max(runner.batch_sizes) == 2
    finally:
        engine.shutdown()


async def test_mock_engine_admits_like_the_engine() -> None:
    engine = MockEngine(token_delay_s=0.002, reply="abcdefgh", max_num_seqs=2, max_waiting=1)
    engine.start()
    streams = [engine.generate(PROMPT, SamplingParams(), f"r{i}") for i in range(3)]
    assert engine.num_waiting() == 1
    with pytest.raises(EngineOverloadedError):
        engine.generate(PROMPT, SamplingParams(), "r3")
    with pytest.raises(SamplingFieldError):
        engine.generate_n(PROMPT, SamplingParams(), "many", 4)
    running: list[int] = []

    async def consume(stream: Any) -> str:
        text = ""
        async for delta in stream:
            running.append(engine.num_running)
            text += delta.text
        return text

    texts = await asyncio.wait_for(asyncio.gather(*map(consume, streams)), 10)
    assert texts == ["abcdefgh"] * 3
    assert max(running) == 2  # the third waited for a slot
    assert engine.num_waiting() == 0 and engine.stats().num_running == 0


# -- over HTTP ----------------------------------------------------------------------------------

BODY = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True}


async def _overload_over_http(
    app_engine: Any, hold: Callable[[], None], release: Callable[[], None], busy: Callable[[], bool]
) -> None:
    """Three requests fill the running slots and the queue; the fourth is a 503 with the
    envelope and Retry-After; once the three finished, a new one is served."""
    async with app_client(create_app(app_engine)) as client:
        hold()
        bodies = [BODY, {**BODY, "stream": True}, BODY]
        tasks = [asyncio.ensure_future(client.post("/v1/completions", json=b)) for b in bodies]
        await until(busy)
        refused = await client.post("/v1/completions", json=BODY)
        assert_error(refused, 503, code="engine_overloaded")
        assert refused.json()["error"]["type"] == "service_unavailable_error"
        assert refused.headers["retry-after"] == "1"
        streamed = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert_error(streamed, 503, code="engine_overloaded")  # refused before any SSE byte
        release()
        responses = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert [r.status_code for r in responses] == [200, 200, 200]
        assert responses[0].json()["choices"][0]["finish_reason"] == "length"
        assert sse_chunks(responses[1].text)[-1]["choices"][0]["finish_reason"] == "length"
        after = await client.post("/v1/completions", json=BODY)
        assert after.status_code == 200, after.text


async def test_http_overload_is_503_with_retry_after_on_the_engine() -> None:
    engine, runner = stub_engine(max_num_seqs=2, max_waiting=1)
    try:
        await _overload_over_http(
            engine, runner.gate.clear, runner.gate.set, lambda: engine.num_waiting() == 1
        )
    finally:
        runner.gate.set()


async def test_http_overload_is_503_with_retry_after_on_the_mock() -> None:
    engine = MockEngine(reply="y" * 40, token_delay_s=0.01, max_num_seqs=2, max_waiting=1)
    await _overload_over_http(engine, lambda: None, lambda: None, lambda: engine.num_waiting() == 1)


async def test_http_n_beyond_the_queue_is_a_400_naming_n() -> None:
    engine = MockEngine(max_num_seqs=2, max_waiting=1)
    async with app_client(create_app(engine)) as client:
        response = await client.post("/v1/completions", json={**BODY, "n": 4})
        assert_error(response, 400, param="n")


# -- configuration ------------------------------------------------------------------------------


def test_max_waiting_flag_reaches_the_config_and_the_mock_engine() -> None:
    args = build_parser().parse_args(["--max-waiting", "7", "--max-num-seqs", "3"])
    config = _config_from_args(args)
    assert (config.max_waiting, config.max_num_seqs) == (7, 3)
    mock = _build_engine(config, mock=True)
    assert isinstance(mock, MockEngine) and (mock.max_waiting, mock.max_num_seqs) == (7, 3)
    assert _config_from_args(build_parser().parse_args([])).max_waiting == DEFAULT_MAX_WAITING


def test_negative_max_waiting_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--max-waiting", "-1"])
    assert exit_.value.code == 2
    assert "--max-waiting" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_waiting"):
        EngineConfig(max_waiting=-1)


def test_engine_overloaded_error_message_names_the_limit() -> None:
    error = EngineOverloadedError(12, 12)
    assert "12" in str(error) and "max_waiting" in str(error)
    assert json.dumps({"m": str(error)})  # a plain string, fit for the envelope
