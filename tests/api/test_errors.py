"""Every client error is a 4xx OpenAI envelope naming the field; never a 500."""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import TestClient

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import MAX_MODEL_LEN, assert_error

Client = TestClient[Any]
HELLO = [{"role": "user", "content": "hello"}]


def chat(client: Client, **fields: Any) -> Any:
    return client.post("/v1/chat/completions", json={"messages": HELLO, **fields})


@pytest.mark.parametrize("body", [b"{", b"", b"not json", b"\xff\xfe", b'{"messages": [}'])
def test_malformed_json_is_400(client: Client, body: bytes) -> None:
    response = client.post("/v1/chat/completions", content=body)
    error = assert_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        ("/v1/chat/completions", b'{"model": "\xc3", "messages": []}'),
        ("/v1/completions", b'{"prompt": "a\xed\xa0\x80b"}'),  # an encoded lone surrogate
        ("/v1/completions", b'{"prompt": "\\ud800"}'),  # an escaped lone surrogate
        ("/v1/embeddings", b'{"input": "\x80"}'),
        ("/tokenize", b'{"prompt": "\xf8\x88\x80\x80\x80"}'),
        ("/v1/responses", b'{"input": "\xfe"}'),
    ],
)
def test_invalid_utf8_in_a_string_is_400(client: Client, path: str, body: bytes) -> None:
    """Bytes that are not UTF-8 inside a JSON string, on every route that reads a body."""
    error = assert_error(client.post(path, content=body), 400)
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]
    assert client.post("/v1/chat/completions", json={"messages": HELLO}).status_code == 200


def test_nesting_past_the_recursion_limit_is_400(client: Client) -> None:
    """msgspec decodes ``Any`` values (here a tool's parameters) by recursion: 10,000 levels."""
    deep = b'{"a":' * 10_000 + b"1" + b"}" * 10_000
    body = (
        b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
        b'"function": {"name": "f", "parameters": ' + deep + b"}}]}"
    )
    error = assert_error(client.post("/v1/chat/completions", content=body), 400)
    assert "nested too deeply" in error["message"]
    assert client.post("/v1/chat/completions", json={"messages": HELLO}).status_code == 200


def test_missing_messages_names_the_param(client: Client) -> None:
    assert_error(client.post("/v1/chat/completions", json={"model": "x"}), 400, param="messages")
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, param="messages")
    assert_error(client.post("/v1/completions", json={}), 400, param="prompt")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        ({"frobnicate": True}, "frobnicate"),
    ],
)
def test_bad_fields_are_400_naming_the_param(
    client: Client, fields: dict[str, Any], param: str
) -> None:
    assert_error(chat(client, **fields), 400, param=param)


def test_unsupported_fields_at_their_defaults_are_accepted(client: Client) -> None:
    defaults = {
        "n": 1,
        "seed": None,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logprobs": False,
        "tools": [],
        "response_format": {"type": "text"},
        "logit_bias": {},
    }
    assert chat(client, **defaults).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {"258": 1}}, "logit_bias"),
        ({"suffix": "x"}, "suffix"),
        ({"prompt": [[104], "b"]}, "prompt"),
        ({"prompt": [1, "b"]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_bad_completion_fields(client: Client, fields: dict[str, Any], param: str) -> None:
    body = {"prompt": "hi", **fields}
    assert_error(client.post("/v1/completions", json=body), 400, param=param)


def test_token_id_outside_the_vocabulary_is_400(client: Client) -> None:
    response = client.post("/v1/completions", json={"prompt": [1, 99999]})
    assert_error(response, 400, code="invalid_prompt")


UNKNOWN_MODEL_BODIES = [
    ("/v1/chat/completions", {"messages": HELLO}),
    ("/v1/completions", {"prompt": "a"}),
    ("/v1/embeddings", {"input": "a"}),
    ("/v1/responses", {"input": "a"}),
    ("/tokenize", {"prompt": "a"}),
]


@pytest.mark.parametrize(("path", "body"), UNKNOWN_MODEL_BODIES)
def test_one_served_model_answers_any_name(client: Client, path: str, body: dict) -> None:
    """candle-vllm's and llama.cpp's clients send any model name (``any``, ``mistral7b``):
    a server of one model answers it, and reports its own name."""
    response = client.post(path, json={**body, "model": "gpt-4"})
    assert response.status_code == 200, response.text
    if "model" in response.json():
        assert response.json()["model"] == "mock-model"


@pytest.mark.parametrize(("path", "body"), UNKNOWN_MODEL_BODIES)
def test_unknown_model_is_404_with_strict_names(engine: MockEngine, path: str, body: dict) -> None:
    config = ServerConfig(strict_model_names=True)
    with TestClient(create_app(engine, config=config)) as strict:
        error = assert_error(strict.post(path, json={**body, "model": "gpt-4"}), 404, "model")
        assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
        assert strict.post(path, json={**body, "model": "mock-model"}).status_code == 200


def test_prompt_longer_than_the_context_is_400(client: Client) -> None:
    long_text = "x" * (MAX_MODEL_LEN + 10)
    error = assert_error(
        chat(client, messages=[{"role": "user", "content": long_text}]),
        400,
        param="messages",
        code="context_length_exceeded",
    )
    assert error["message"].startswith(
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested"
    )
    response = client.post("/v1/completions", json={"prompt": long_text})
    assert_error(response, 400, param="prompt", code="context_length_exceeded")


def test_an_echoed_prompt_longer_than_the_context_is_refused_before_it_is_scored(
    client: Client, engine: MockEngine
) -> None:
    """The engine's one context check answers before the prompt's echo logprobs are computed
    (a prompt of the whole context could be scored, but leaves no room to generate)."""
    scored: list[int] = []

    async def prompt_logprobs(ids: list[int], top: int) -> Any:
        scored.append(len(ids))
        return [None] * len(ids)

    engine.prompt_logprobs = prompt_logprobs  # type: ignore[method-assign]
    prompt = list(range(65, 65 + 26)) * (MAX_MODEL_LEN // 26 + 1)
    body = {"prompt": prompt[:MAX_MODEL_LEN], "echo": True, "logprobs": 1, "max_tokens": 1}
    response = client.post("/v1/completions", json=body)
    assert_error(response, 400, "prompt", "context_length_exceeded")
    assert not scored


def test_a_batch_with_one_prompt_beyond_the_context_starts_nothing(
    client: Client, engine: MockEngine
) -> None:
    """The other prompts of the batch are aborted before the 400 goes out."""
    prompts = ["short", "x" * (MAX_MODEL_LEN + 10)]
    response = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 4})
    assert_error(response, 400, param="prompt", code="context_length_exceeded")
    assert len(engine.requests) == 1 and engine.requests[0].request_id in engine.aborted


def test_max_tokens_beyond_the_context_is_lowered_to_the_room_left(client: Client) -> None:
    """As candle-vllm and llama.cpp do (their clients send fixed budgets such as 16,384): the
    completion gets what the prompt leaves and ends with "length"."""
    reply = chat(client, max_tokens=MAX_MODEL_LEN, ignore_eos=True)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN
    assert body["choices"][0]["finish_reason"] == "length"


def test_litestar_errors_use_the_envelope(client: Client) -> None:
    assert_error(client.get("/nope"), 404)
    error = assert_error(client.get("/v1/chat/completions"), 405)
    assert "GET" in error["message"]
    assert_error(client.post("/v1/models"), 405)


def test_oversized_body_is_413(client: Client) -> None:
    body = b'{"prompt": "' + b"x" * (11 * 2**20) + b'"}'
    assert_error(client.post("/v1/completions", content=body), 413)


def test_bad_chat_template_kwargs_is_400(client: Client) -> None:
    response = chat(client, chat_template_kwargs={"add_generation_prompt": False})
    assert_error(response, 400, param="chat_template_kwargs")


def test_template_error_is_400(
    client: Client, engine: MockEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_template(*args: Any, **kwargs: Any) -> str:
        raise ValueError("template exploded")  # what ChatTemplateError (a ValueError) looks like

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", broken_template)
    error = assert_error(chat(client), 400, param="messages")
    assert "template exploded" in error["message"]


def test_unexpected_errors_are_a_logged_500_envelope(
    client: Client, engine: MockEngine, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    def broken_encode(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(engine.tokenizer, "encode", broken_encode)
    error = assert_error(client.post("/v1/completions", json={"prompt": "a"}), 500)
    assert error["type"] == "internal_server_error"
    assert "tokenizer bug" not in error["message"]  # internals stay in the log
    assert "tokenizer bug" in caplog.text


def test_litestar_validation_errors_use_the_envelope() -> None:
    """Handlers that let Litestar validate parameters get the envelope too, naming the key."""
    from litestar import Litestar, get

    from jax_llm_runtime.api.protocol.errors import exception_handlers

    @get("/count", sync_to_thread=False)
    def count(n: int) -> dict[str, int]:
        return {"n": n}

    app = Litestar([count], exception_handlers=exception_handlers(), logging_config=None)
    with TestClient(app) as test_client:
        assert test_client.get("/count?n=3").json() == {"n": 3}
        assert_error(test_client.get("/count?n=abc"), 400, param="n")


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}},
    ],
)
def test_a_bad_response_format_is_400_before_the_engine(
    client: Client, response_format: dict[str, Any]
) -> None:
    assert_error(chat(client, response_format=response_format), 400, param="response_format")


def test_a_valid_schema_reaches_the_engine(client: Client) -> None:
    # The mock engine cannot follow a grammar and says so; a real engine enforces it
    # (tests/runtime/test_structured_output_smollm2.py).
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    error = assert_error(chat(client, response_format=fmt), 400, param="response_format")
    assert "cannot constrain" in error["message"]
