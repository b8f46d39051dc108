"""What one request may hold: header and body size, list lengths, integer widths, token ids.

Each cap is a 4xx OpenAI envelope naming the field (the n, top_logprobs, max_tokens, body size
and stop-count caps have their tests in test_choices_and_caps, test_errors and test_service).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.protocol.bodies import MAX_MESSAGES, MAX_STOP_STRING_CHARS, MAX_TOOLS
from jax_llm_runtime.api.service.limits import MAX_REQUEST_HEADER_BYTES
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.mock import VOCAB_SIZE, MockEngine
from jax_llm_runtime.runtime.engine.request import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from tests.api.conftest import assert_error

Client = TestClient[Any]
HELLO = [{"role": "user", "content": "hello"}]


def chat(client: Client, **fields: Any) -> Any:
    return client.post("/v1/chat/completions", json={"messages": HELLO, **fields})


def test_headers_over_the_cap_are_431_naming_the_largest(client: Client) -> None:
    under = client.get("/health", headers={"x-filler": "a" * (MAX_REQUEST_HEADER_BYTES // 2)})
    assert under.status_code == 200
    big = {"x-filler": "a" * MAX_REQUEST_HEADER_BYTES}
    error = assert_error(client.get("/health", headers=big), 431, code="request_headers_too_large")
    assert "`x-filler`" in error["message"]
    assert_error(_chat_with(client, big), 431)
    many = {f"x-h{i}": "a" * 100 for i in range(MAX_REQUEST_HEADER_BYTES // 100)}
    assert_error(client.get("/v1/models", headers=many), 431, code="request_headers_too_large")


def _chat_with(client: Client, headers: dict[str, str]) -> Any:
    return client.post("/v1/chat/completions", json={"messages": HELLO}, headers=headers)


@pytest.fixture
def small_body_client(engine: MockEngine) -> Iterator[Client]:
    with TestClient(create_app(engine, config=ServerConfig(max_request_body_bytes=2048))) as c:
        yield c


def test_chunked_body_over_the_cap_is_413(small_body_client: Client) -> None:
    """Without a Content-Length the body is counted as it arrives."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"x" * 512
        yield b'"}'

    response = small_body_client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert "content-length" not in response.request.headers
    assert_error(response, 413)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({"stop": ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop[1]"),
        ({"messages": HELLO * (MAX_MESSAGES + 1)}, "messages"),
        ({"tools": [{"type": "function"}] * (MAX_TOOLS + 1)}, "tools"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ],
)
def test_lists_past_their_cap_are_400_naming_the_field(
    client: Client, fields: dict[str, Any], param: str
) -> None:
    error = assert_error(chat(client, **fields), 400, param=param)
    assert "length <=" in error["message"], error


def test_the_caps_themselves_are_accepted(client: Client) -> None:
    at_cap = {
        "stop": ["x" * MAX_STOP_STRING_CHARS],
        "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS,
        "logit_bias": {str(i): 1 for i in range(min(MAX_LOGIT_BIAS, VOCAB_SIZE))},
    }
    assert chat(client, **at_cap).status_code == 200
    many_messages = [{"role": "user", "content": ""}] * MAX_MESSAGES
    # Decoding accepts them; the rendered chat is then too long for the mock's context.
    error = assert_error(chat(client, messages=many_messages), 400, param="messages")
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": 2**31}, "top_k"),  # the engine packs it into int32
        ({"stop_token_ids": [2**31]}, "stop_token_ids[0]"),
        ({"seed": 2**63}, "seed"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        (
            {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "messages[0].content[0].type",
        ),
        ({"chat_template_kwargs": {"template": "{{ 1 }}"}}, "chat_template_kwargs"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(
    client: Client, fields: dict[str, Any], param: str
) -> None:
    assert_error(chat(client, **fields), 400, param=param)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"custom_var": 1},  # not on the allow-list
        {"messages": []},
        {"enable_thinking": {"nested": True}},  # only scalars
        {"date_string": "x" * 5000},
    ],
)
def test_chat_template_kwargs_pass_an_allow_list_of_scalars(
    client: Client, kwargs: dict[str, Any]
) -> None:
    assert_error(chat(client, chat_template_kwargs=kwargs), 400, param="chat_template_kwargs")


def test_allowed_chat_template_kwargs_are_accepted(client: Client) -> None:
    kwargs = {"enable_thinking": False, "reasoning_effort": "low", "date_string": "21 Nov 2026"}
    assert chat(client, chat_template_kwargs=kwargs).status_code == 200


def test_a_request_supplied_chat_template_is_refused(client: Client) -> None:
    response = chat(client, chat_template="{{ messages }}")
    assert response.status_code == 400 and "chat_template" in response.text


def test_tokenize_refuses_a_template_kwarg_the_server_sets(client: Client) -> None:
    body = {"messages": HELLO, "chat_template_kwargs": {"template": "x"}}
    assert_error(client.post("/tokenize", json=body), 400, param="chat_template_kwargs")


@pytest.mark.parametrize("token_id", [VOCAB_SIZE, 2**31, 2**40])
def test_token_ids_outside_the_vocabulary_are_refused_before_the_engine(
    client: Client, engine: MockEngine, token_id: int
) -> None:
    response = client.post("/v1/completions", json={"prompt": [1, token_id]})
    assert_error(response, 400, param="prompt", code="invalid_prompt")
    echoed = {"prompt": [token_id], "echo": True, "logprobs": 1}
    assert_error(client.post("/v1/completions", json=echoed), 400, param="prompt")
    if token_id < 2**31:  # wider ids are refused by the schema (input[0][0])
        response = client.post("/v1/embeddings", json={"input": [[1, token_id]]})
        assert_error(response, 400, param="input", code="invalid_token_id")
    assert engine.requests == []


def test_echo_with_logprobs_on_a_stopped_engine_is_503(
    client: Client, engine: MockEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def stopped(*_: Any) -> None:
        raise RuntimeError("the engine is not running")  # what runtime.engine.core.Engine raises

    monkeypatch.setattr(engine, "prompt_logprobs", stopped)
    engine.mark_unhealthy()
    body = {"prompt": "hi", "echo": True, "logprobs": 1}
    assert_error(client.post("/v1/completions", json=body), 503, code="engine_unhealthy")
