"""``InferenceEngine`` over the deterministic mock engine: the request path without a model.

Stop strings, finish reasons, token counts, streams (and aborting them), chat rendering, async
calls, embeddings, interrupts and closing, through ``InferenceEngine.from_engine``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from jax_llm_runtime.runtime import GenerationError, InferenceEngine
from jax_llm_runtime.runtime.engine.mock import EMBED_DIM, EOS_ID, MockEngine
from jax_llm_runtime.runtime.engine.request import ContextLengthError


@pytest.fixture
def mock() -> MockEngine:
    return MockEngine(max_model_len=256)


@pytest.fixture
def engine(mock: MockEngine) -> Iterator[InferenceEngine]:
    with InferenceEngine.from_engine(mock) as wrapped:
        yield wrapped


def test_generate_returns_text_ids_reason_and_counts(engine: InferenceEngine) -> None:
    completion = engine.generate("abc", max_tokens=10)
    # The mock answers a plain prompt with its text reversed, then EOS.
    assert completion.text == "cba"
    assert completion.token_ids == (ord("c"), ord("b"), ord("a"), EOS_ID)
    assert completion.finish_reason == "stop"
    assert (completion.prompt_tokens, completion.completion_tokens) == (4, 4)  # BOS + 3 bytes
    assert completion.total_tokens == 8


def test_max_tokens_ends_with_length(engine: InferenceEngine) -> None:
    completion = engine.generate("abcdef", max_tokens=2)
    assert (completion.text, completion.finish_reason, completion.completion_tokens) == (
        "fe",
        "length",
        2,
    )


def test_token_id_prompts_are_used_as_given(engine: InferenceEngine, mock: MockEngine) -> None:
    assert engine.generate([ord("x"), ord("y")], max_tokens=8).text == "yx"
    assert mock.requests[-1].prompt_token_ids == (ord("x"), ord("y"))


def test_stop_string_cuts_the_text_and_aborts_the_sequence(mock: MockEngine) -> None:
    mock.reply = "Hello world. END and more text that is never generated"
    with InferenceEngine.from_engine(mock) as engine:
        completion = engine.generate("hi", max_tokens=100, stop=["END", "zzz"])
        assert completion.text == "Hello world. "
        assert completion.finish_reason == "stop"
        assert completion.token_ids[-3:] == tuple(b"END")  # the stop string's tokens count
        assert mock.wait_for_aborts(1)
        pieces = list(engine.generate_stream("hi", max_tokens=100, stop="END"))
        assert "".join(pieces) == "Hello world. "
        assert all("E" not in p for p in pieces)  # no part of the stop string is shown


def test_stream_yields_the_text_and_leaving_early_aborts(
    engine: InferenceEngine, mock: MockEngine
) -> None:
    assert "".join(engine.generate_stream("hello", max_tokens=10)) == "olleh"
    stream = engine.generate_stream("a long prompt to reverse", max_tokens=30)
    assert next(stream) == "e"
    stream.close()
    assert mock.wait_for_aborts(1)
    assert mock.aborted == [mock.requests[-1].request_id]


def test_chat_renders_the_template_like_the_chat_route(
    engine: InferenceEngine, mock: MockEngine
) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "abc"},
    ]
    assert engine.chat(messages, max_tokens=10).text == "cba"
    prompt = mock.tokenizer.decode(mock.requests[-1].prompt_token_ids)
    assert prompt == engine.detokenize(engine.chat_prompt_ids(messages))
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")  # developer -> system
    assert prompt.endswith("<|im_start|>assistant\n")
    assert mock.requests[-1].prompt_token_ids[0] != 256  # no BOS added to the template's text
    assert "".join(engine.chat_stream(messages, max_tokens=10)) == "cba"
    engine.chat(messages, chat_template_kwargs={"enable_thinking": False}, max_tokens=2)
    assert mock.tokenizer.template_kwargs[-1] == {"enable_thinking": False}


async def test_async_calls_run_concurrently_on_the_callers_loop(
    engine: InferenceEngine,
) -> None:
    replies = await asyncio.gather(*(engine.agenerate(p, max_tokens=8) for p in ("ab", "cd", "ef")))
    assert [r.text for r in replies] == ["ba", "dc", "fe"]
    pieces = [p async for p in engine.achat_stream([{"role": "user", "content": "xyz"}])]
    assert "".join(pieces) == "zyx"
    assert (await engine.achat([{"role": "user", "content": "q"}])).text == "q"
    assert [p async for p in engine.agenerate_stream("no", max_tokens=5)] == ["o", "n"]


async def test_sync_methods_work_inside_a_running_loop(engine: InferenceEngine) -> None:
    # As in a Jupyter cell: the caller's loop is running, and the plain methods still work.
    asyncio.get_running_loop()
    assert engine.generate("abc", max_tokens=8).text == "cba"
    assert list(engine.chat_stream([{"role": "user", "content": "hi"}])) == ["i", "h"]


def test_tokens_and_embeddings(engine: InferenceEngine) -> None:
    ids = engine.tokenize("hé")
    assert ids == [256, *"hé".encode()]
    assert engine.detokenize(ids) == "hé"
    vectors = engine.embed(["one", "two"])
    assert vectors.shape == (2, EMBED_DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    raw = engine.embed("one", pooling="last", normalize=False)
    assert raw.shape == (1, EMBED_DIM)
    with pytest.raises(ValueError, match="pooling"):
        engine.embed("one", pooling="max")
    with pytest.raises(ValueError, match="non-empty"):
        engine.embed(["one", ""])


def test_errors_reach_the_caller(engine: InferenceEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.generate("")
    with pytest.raises(ContextLengthError, match="maximum context length is 256 tokens"):
        engine.generate("x" * 300)
    with pytest.raises(TypeError, match="max_new_tokens"):
        engine.generate("x", max_new_tokens=3)
    with pytest.raises(TypeError, match="max_new_tokens"):
        list(engine.generate_stream("x", max_new_tokens=3))


def test_engine_shutdown_mid_stream_is_a_generation_error(mock: MockEngine) -> None:
    mock.reply = "x" * 200
    mock.token_delay_s = 0.01
    with InferenceEngine.from_engine(mock) as engine:
        stream = engine.generate_stream("hi", max_tokens=200)
        assert next(stream) == "x"
        mock.shutdown()
        with pytest.raises(GenerationError, match="engine stopped"):
            list(stream)


def test_ctrl_c_while_waiting_aborts_the_request(mock: MockEngine) -> None:
    mock.replies.append("y" * 200)
    mock.token_delay_s = 0.01
    with InferenceEngine.from_engine(mock) as engine:
        # A real SIGINT, as Ctrl+C sends: it wakes the main thread blocked on the result.
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            engine.generate("hi", max_tokens=200)
        timer.join()
        # The abort was posted before the interrupt reached the caller.
        assert mock.aborted == [mock.requests[-1].request_id]
        assert engine.generate("ok", max_tokens=5).text == "ko"  # still serving


def test_close_stops_the_engine_and_refuses_further_calls(mock: MockEngine) -> None:
    engine = InferenceEngine.from_engine(mock)
    assert mock.healthy()
    engine.close()
    engine.close()  # idempotent
    assert not mock.healthy()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate("x")
