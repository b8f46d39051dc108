"""The OpenAI routes against the mock engine: JSON and SSE bodies, usage, models, health."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from litestar.testing import TestClient

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import assert_error, sse_chunks

Client = TestClient[Any]
HELLO = [{"role": "user", "content": "hello"}]


def test_models_lists_the_served_model(client: Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "mock-model"
    assert card["object"] == "model"
    assert isinstance(card["created"], int) and card["owned_by"]
    assert client.get("/v1/models/mock-model").json()["id"] == "mock-model"
    assert client.get("/v1/models/other").status_code == 404


def test_health_follows_the_engine(client: Client, engine: MockEngine) -> None:
    assert client.get("/health").status_code == 200
    engine.mark_unhealthy()
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable_error"


def test_chat_json_with_usage(client: Client, engine: MockEngine) -> None:
    response = client.post("/v1/chat/completions", json={"model": "mock-model", "messages": HELLO})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and body["model"] == "mock-model"
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "olleh"}
    assert choice["finish_reason"] == "stop"
    [record] = engine.requests
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(record.prompt_token_ids)
    assert usage["completion_tokens"] == len("olleh") + 1  # the reply, then EOS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_passes_sampling_and_renders_without_special_tokens(
    client: Client, engine: MockEngine
) -> None:
    body = {
        "messages": [{"role": "developer", "content": "be brief"}, *HELLO],
        "temperature": 0,
        "top_p": 0.5,
        "top_k": -1,
        "max_completion_tokens": 3,
        "max_tokens": 100,
        "seed": None,
        "n": 1,
        "user": "someone",
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "oll"},
        "finish_reason": "length",
        "logprobs": None,
    }
    [record] = engine.requests
    assert record.sampling.temperature == 0.0 and record.sampling.top_p == 0.5
    assert record.sampling.top_k == 0 and record.sampling.max_tokens == 3
    prompt = engine.tokenizer.decode(record.prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nbe brief<|im_end|>")  # no BOS before it


def test_chat_text_parts_are_joined(client: Client) -> None:
    content = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]
    response = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]}
    )
    assert response.json()["choices"][0]["message"]["content"] == "dc\nba"


def test_chat_streaming_chunks(client: Client) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(response.text)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert text == "olleh"
    finish, usage = chunks[-2], chunks[-1]
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["choices"][0]["delta"] == {}
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 6


def test_chat_streaming_without_usage_chunk(client: Client) -> None:
    response = client.post("/v1/chat/completions", json={"messages": HELLO, "stream": True})
    chunks = sse_chunks(response.text)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks)


def test_stop_string_truncates_and_aborts_the_engine(client: Client, engine: MockEngine) -> None:
    body = {"messages": [{"role": "user", "content": "abc:xyz"}], "stop": ["x", ":"]}
    response = client.post("/v1/chat/completions", json=body)
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "zy"
    assert choice["finish_reason"] == "stop"
    assert engine.aborted == [response.json()["id"]]


@pytest.mark.parametrize(
    ("stop", "text"), [({"Single": ":"}, "zyx"), ({"Multi": ["x", ":"]}, "zy")]
)
def test_candle_vllm_tagged_stop_is_read(client: Client, stop: dict, text: str) -> None:
    """candle-vllm's README sends ``"stop": {"Single": "</s>"}`` (its tagged form)."""
    body = {"messages": [{"role": "user", "content": "abc:xyz"}], "stop": stop}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["content"] == text and choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "stop", [{}, {"Single": ":", "Multi": [":"]}, {"Single": ""}, {"Other": ":"}]
)
def test_a_bad_tagged_stop_is_400(client: Client, stop: dict) -> None:
    body = {"messages": [{"role": "user", "content": "abc:xyz"}], "stop": stop}
    error = assert_error(client.post("/v1/chat/completions", json=body), 400)
    assert "stop" in error["message"]


def test_stop_string_is_never_streamed_in_part(client: Client) -> None:
    body = {"prompt": "dcba-cba", "stop": "abcd", "stream": True, "max_tokens": 50}
    chunks = sse_chunks(client.post("/v1/completions", json=body).text)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "abc-"  # "abc" was held back until "-" showed it was not "abcd"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completions_json(client: Client, engine: MockEngine) -> None:
    response = client.post("/v1/completions", json={"prompt": "abc", "model": ""})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "cba"
    assert body["choices"][0]["finish_reason"] == "stop"
    counts = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert counts == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert engine.requests[0].sampling.max_tokens == 16  # OpenAI's completions default


def test_completions_token_ids_and_single_text_list(client: Client) -> None:
    ids = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 5}).json()
    assert ids["choices"][0]["text"] == "ih"
    one = client.post("/v1/completions", json={"prompt": ["xy"], "max_tokens": 1}).json()
    assert one["choices"][0] == {
        "index": 0,
        "text": "y",
        "finish_reason": "length",
        "logprobs": None,
    }


def test_completions_batch_of_texts_gets_n_choices_per_prompt(
    client: Client, engine: MockEngine
) -> None:
    body = {"prompt": ["abc", "xy"], "n": 2, "max_tokens": 8}
    response = client.post("/v1/completions", json=body).json()
    texts = [(c["index"], c["text"]) for c in response["choices"]]
    assert texts == [(0, "cba"), (1, "cba"), (2, "yx"), (3, "yx")]
    usage = response["usage"]
    # Each prompt counts once (BOS + its bytes), each choice's tokens count (reply + EOS).
    assert usage["prompt_tokens"] == 4 + 3 and usage["completion_tokens"] == 2 * 4 + 2 * 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    prompts = sorted(r.prompt_token_ids[1:] for r in engine.requests)  # after the BOS
    assert prompts == [(97, 98, 99), (97, 98, 99), (120, 121), (120, 121)]


def test_completions_batch_of_token_id_lists_streams_each_choice(client: Client) -> None:
    body = {
        "prompt": [[104, 105], [120, 121, 122]],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = sse_chunks(client.post("/v1/completions", json=body).text)
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "ih", 1: "zyx"}
    assert chunks[-1]["usage"]["prompt_tokens"] == 2 + 3


def test_a_bad_prompt_in_a_batch_refuses_the_whole_batch(
    client: Client, engine: MockEngine
) -> None:
    body = {"prompt": [[104, 105], [104, 999999]]}
    error = assert_error(client.post("/v1/completions", json=body), 400)
    assert error["param"] == "prompt"
    assert engine.requests == []  # checked before any prompt was submitted
    too_many = {"prompt": ["a"] * 129}
    assert (
        "at most 128" in assert_error(client.post("/v1/completions", json=too_many), 400)["message"]
    )


def test_completions_streaming(client: Client) -> None:
    body = {"prompt": "héllo", "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(client.post("/v1/completions", json=body).text)
    assert {c["object"] for c in chunks} == {"text_completion"}
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == "olléh"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 7


def test_engine_shutdown_mid_request_is_503(engine: MockEngine) -> None:
    engine.reply = "x" * 100
    engine.token_delay_s = 0.01
    with TestClient(create_app(engine)) as test_client:
        timer = threading.Timer(0.1, engine.shutdown)
        timer.start()
        response = test_client.post("/v1/completions", json={"prompt": "a", "max_tokens": 100})
        timer.join()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_aborted"
