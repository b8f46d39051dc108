"""``n`` > 1 (several choices of one prompt, JSON and streamed) and the server caps on n and top_logprobs."""

from __future__ import annotations

from typing import Any

from litestar.testing import TestClient

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import assert_error, sse_chunks

CHAT = {"messages": [{"role": "user", "content": "hello"}]}


def test_chat_n_returns_n_indexed_choices_and_counts_the_prompt_once(client: TestClient[Any]):
    one = client.post("/v1/chat/completions", json=CHAT).json()
    three = client.post("/v1/chat/completions", json={**CHAT, "n": 3}).json()
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "olleh" for c in three["choices"])
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]


def test_chat_n_streams_every_choice_with_one_finish_each(client: TestClient[Any]):
    body = {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(client.post("/v1/chat/completions", json=body).text)
    text = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        text[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert text == {0: "olleh", 1: "olleh"}
    assert finishes == {0: ["stop"], 1: ["stop"]}
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 2 * 6


def test_completions_n(client: TestClient[Any]):
    reply = client.post("/v1/completions", json={"prompt": "abc", "n": 2, "max_tokens": 2}).json()
    assert [(c["index"], c["finish_reason"]) for c in reply["choices"]] == [
        (0, "length"),
        (1, "length"),
    ]


def test_n_above_the_server_cap_is_400_naming_n():
    engine = MockEngine(model_name="mock-model", max_model_len=256)
    with TestClient(create_app(engine, config=ServerConfig(max_n=2))) as client:
        assert_error(client.post("/v1/chat/completions", json={**CHAT, "n": 3}), 400, param="n")
        assert_error(client.post("/v1/chat/completions", json={**CHAT, "n": 0}), 400, param="n")


def test_top_logprobs_above_the_server_cap_is_400():
    engine = MockEngine(model_name="mock-model", max_model_len=256)
    with TestClient(create_app(engine, config=ServerConfig(max_top_logprobs=2))) as client:
        body = {**CHAT, "logprobs": True, "top_logprobs": 3}
        assert_error(client.post("/v1/chat/completions", json=body), 400, param="top_logprobs")
        ok = client.post("/v1/chat/completions", json={**body, "top_logprobs": 2})
        assert ok.status_code == 200
        bad = client.post("/v1/completions", json={"prompt": "a", "logprobs": 3})
        assert_error(bad, 400, param="logprobs")
