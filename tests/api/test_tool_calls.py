"""Tool calling on /v1/chat/completions over the mock engine, whose reply is scripted: requests
are checked and rendered, replies parsed into ``tool_calls`` (JSON and streamed), history with
calls and tool results accepted. Forced calls (grammars) run on the real model in
tests/e2e/test_serve_smollm2.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import assert_error, sse_data

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
REPLY = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def client_for(reply: str, tool_parser: str = "hermes") -> Iterator[TestClient[Any]]:
    engine = MockEngine(reply=reply, max_model_len=2048)
    with TestClient(create_app(engine, config=ServerConfig(tool_parser=tool_parser))) as client:
        yield client


@pytest.fixture
def client() -> Iterator[TestClient[Any]]:
    yield from client_for(REPLY)


def chat(client: TestClient[Any], **fields: Any) -> Any:
    body = {"model": "mock-model", "messages": ASK, "tools": [WEATHER], **fields}
    return client.post("/v1/chat/completions", json=body)


def test_a_reply_with_a_call_becomes_tool_calls(client: TestClient[Any]) -> None:
    response = chat(client)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_streamed_calls_come_as_deltas_without_markup(client: TestClient[Any]) -> None:
    response = chat(client, stream=True)
    events = [json.loads(d) for d in sse_data(response.text)[:-1]]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check." and "<tool_call>" not in content
    items = [item for d in deltas for item in d.get("tool_calls", [])]
    first, *rest = items
    assert first["index"] == 0 and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    arguments = first["function"]["arguments"] + "".join(i["function"]["arguments"] for i in rest)
    assert json.loads(arguments) == {"city": "Paris"}
    assert all("id" not in i and i["index"] == 0 for i in rest)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_plain_answer_stays_content() -> None:
    for client in client_for("It is sunny."):
        choice = chat(client).json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == "It is sunny."
        assert "tool_calls" not in choice["message"]


def test_tool_choice_none_leaves_the_reply_unparsed(client: TestClient[Any]) -> None:
    message = chat(client, tool_choice="none").json()["choices"][0]["message"]
    assert message["content"] == REPLY  # verbatim
    assert "tool_calls" not in message


def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    reply = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    engine = MockEngine(reply=reply, max_model_len=2048)
    with TestClient(create_app(engine, config=ServerConfig(tool_parser="auto"))) as client:
        (call,) = chat(client).json()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    system = prompt.split("<|im_start|>user")[0]
    assert system.startswith("<|im_start|>system") and '"name": "get_weather"' in system


def test_history_with_calls_and_tool_results_is_accepted(client: TestClient[Any]) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    assert chat(client, messages=messages).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools[0].function",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[0].function",
        ),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        (
            {
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "function": {}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(
    client: TestClient[Any], fields: dict[str, Any], param: str
) -> None:
    assert_error(chat(client, **fields), 400, param=param)


def test_a_forced_call_needs_an_engine_that_constrains_output(client: TestClient[Any]) -> None:
    # The mock engine cannot follow a grammar; the real one does (e2e tests).
    error = assert_error(chat(client, tool_choice="required"), 400)
    assert "cannot constrain" in error["message"]
