"""The newer models' formats through the chat route (mock engine, scripted replies): gpt-oss's
harmony channels split into reasoning, content and calls, with and without tools, whole and
streamed; GLM 4.5 and Qwen3-Coder calls after ``<think>`` reasoning, their values typed by the
request's tool schemas; Gemma 4's calls after its thought channel. And the harmony reasoning
split on its own, at random cuts."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.generation.reasoning import HarmonyReasoningParser
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.api.tool_calling.parsers import PARSERS, collect
from jax_llm_runtime.runtime.engine.mock import MockEngine
from jax_llm_runtime.runtime.text.tokenizer import (
    GEMMA4_MARKERS,
    HARMONY_MARKERS,
    detect_reasoning_markers,
)
from tests.api.conftest import assert_error, sse_chunks

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]

GPT_OSS_CALL = (
    "<|channel|>analysis<|message|>Need forecast; call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris","days":3}<|call|>'
)
GPT_OSS_ANSWER = (
    "<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Hi there!<|return|>"
)


def client_for(
    reply: str, tool_parser: str, markers: tuple[str, str] | None
) -> Iterator[TestClient[Any]]:
    engine = MockEngine(reply=reply, max_model_len=2048)
    engine.tokenizer.reasoning_markers = markers
    with TestClient(create_app(engine, config=ServerConfig(tool_parser=tool_parser))) as client:
        yield client


def chat(client: TestClient[Any], **fields: Any) -> Any:
    body = {"model": "mock-model", "messages": ASK, "tools": [WEATHER], **fields}
    return client.post("/v1/chat/completions", json=body)


def streamed(client: TestClient[Any], **fields: Any) -> dict[str, Any]:
    """A streamed reply reassembled: content, reasoning, calls (OpenAI items), finish reason."""
    response = chat(client, stream=True, **fields)
    assert response.status_code == 200, response.text
    chunks = [c for c in sse_chunks(response.text) if c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls: dict[int, dict[str, Any]] = {}
    for item in (i for d in deltas for i in d.get("tool_calls", [])):
        if "id" in item:
            calls[item["index"]] = item
        else:
            calls[item["index"]]["function"]["arguments"] += item["function"]["arguments"]
    return {
        "content": "".join(d.get("content") or "" for d in deltas),
        "reasoning": "".join(d.get("reasoning_content") or "" for d in deltas),
        "calls": [calls[i]["function"] for i in sorted(calls)],
        "finish": chunks[-1]["choices"][0]["finish_reason"],
    }


def test_gpt_oss_reasoning_preamble_and_call() -> None:
    for client in client_for(GPT_OSS_CALL, "openai", HARMONY_MARKERS):
        choice = chat(client).json()["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert message["reasoning_content"] == "Need forecast; call get_weather."
        assert message["content"] == "Checking the forecast."
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris","days":3}'}
        got = streamed(client)
        assert got == {
            "content": "Checking the forecast.",
            "reasoning": "Need forecast; call get_weather.",
            "calls": [call["function"]],
            "finish": "tool_calls",
        }


def test_gpt_oss_answer_without_tools_is_split_by_channel() -> None:
    for client in client_for(GPT_OSS_ANSWER, "auto", HARMONY_MARKERS):
        body = {"model": "mock-model", "messages": ASK}
        response = client.post("/v1/chat/completions", json=body)
        message = response.json()["choices"][0]["message"]
        assert message["content"] == "Hi there!"
        assert message["reasoning_content"] == "User greets."
        usage = response.json()["usage"]["completion_tokens_details"]
        assert usage["reasoning_tokens"] == len("User greets.")  # byte-level mock tokens


def test_glm45_call_after_thinking_has_typed_arguments() -> None:
    reply = (
        "<think>The user wants a 3-day forecast.</think>\n<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>3</arg_value>\n</tool_call>"
    )
    for client in client_for(reply, "glm45", ("<think>", "</think>")):
        message = chat(client).json()["choices"][0]["message"]
        assert message["reasoning_content"] == "The user wants a 3-day forecast."
        assert message["content"] is None
        (call,) = message["tool_calls"]
        assert call["function"] == {
            "name": "get_weather",
            "arguments": '{"city": "Paris", "days": 3}',
        }
        got = streamed(client)
        assert got["calls"] == [call["function"]] and got["content"] == ""
        assert got["finish"] == "tool_calls"


def test_qwen3_coder_calls_stream_as_deltas() -> None:
    reply = (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNice\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    for client in client_for(reply, "qwen3_coder", None):
        got = streamed(client)
        assert got["content"] == "Let me check."
        assert [json.loads(c["arguments"]) for c in got["calls"]] == [
            {"city": "Paris", "days": 3},
            {"city": "Nice"},
        ]
        message = chat(client).json()["choices"][0]["message"]
        assert [c["function"] for c in message["tool_calls"]] == got["calls"]


GEMMA4_CALLS = (
    "<|channel>thought\nThe user wants Paris for 3 days and Lyon too.<channel|>"
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
    '<|tool_call>call:get_weather{city:<|"|>Lyon<|"|>}<tool_call|>'
)


def test_gemma4_calls_after_its_thought_channel() -> None:
    for client in client_for(GEMMA4_CALLS, "gemma4", GEMMA4_MARKERS):
        choice = chat(client).json()["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert message["reasoning_content"] == "The user wants Paris for 3 days and Lyon too."
        assert message["content"] is None
        functions = [call["function"] for call in message["tool_calls"]]
        assert functions == [
            {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
            {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
        ]
        got = streamed(client)
        assert got == {
            "content": "",
            "reasoning": message["reasoning_content"],
            "calls": functions,
            "finish": "tool_calls",
        }


def test_gemma4_answer_keeps_special_tokens_for_its_channel() -> None:
    reply = "<|channel>thought\nA greeting.<channel|>Hi there!<|channel>thought\n<channel|>"
    engine = MockEngine(reply=reply, max_model_len=2048)
    engine.tokenizer.reasoning_markers = GEMMA4_MARKERS
    with TestClient(create_app(engine)) as client:
        body = {"model": "mock-model", "messages": ASK}
        response = client.post("/v1/chat/completions", json=body)
    message = response.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("A greeting.", "Hi there!")
    assert engine.requests[-1].sampling.skip_special_tokens is False


def test_gemma4_call_cut_off_by_max_tokens_is_dropped() -> None:
    reply = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
    for client in client_for(reply, "gemma4", GEMMA4_MARKERS):
        choice = chat(client, max_tokens=40).json()["choices"][0]  # cut inside "Paris"
        assert choice["finish_reason"] == "length"
        assert "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == ""  # the markup never reaches it


@pytest.mark.parametrize("parser", ["qwen3_coder", "glm45", "minimax_m2", "gemma4", "openai"])
def test_forced_calls_are_refused_for_formats_without_a_grammar(parser: str) -> None:
    for client in client_for("x", parser, None):
        error = assert_error(chat(client, tool_choice="required"), 400, param="tool_choice")
        assert parser in error["message"]


# The harmony reasoning split on its own.

SPLITS = [
    (GPT_OSS_ANSWER, "User greets.", "Hi there!"),
    (
        GPT_OSS_CALL,
        "Need forecast; call get_weather.",
        "Checking the forecast.<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city":"Paris","days":3}<|call|>',
    ),
    ("Plain text, no channels.", "", "Plain text, no channels."),
    ("<|channel|>analysis<|message|>cut off <|en", "cut off <|en", ""),
]


def _split(text: str, rng: random.Random | None) -> list[str]:
    if rng is None:
        return list(text)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("reply", "reasoning", "content"), SPLITS)
def test_harmony_split_at_any_cuts(reply: str, reasoning: str, content: str) -> None:
    rng = random.Random(reply)
    for pieces in [[reply], _split(reply, None), *(_split(reply, rng) for _ in range(30))]:
        parser = HarmonyReasoningParser()
        outs = [parser.feed(piece, 1) for piece in pieces] + [parser.flush()]
        assert "".join(o.reasoning for o in outs) == reasoning, pieces
        assert "".join(o.content for o in outs) == content, pieces


def test_harmony_split_then_tool_parser_equals_the_parser_alone() -> None:
    splitter = HarmonyReasoningParser()
    content = splitter.feed(GPT_OSS_CALL).content + splitter.flush().content
    after = PARSERS["openai"]().parse(content)
    alone = PARSERS["openai"]().parse(GPT_OSS_CALL)
    assert after.content == alone.content == "Checking the forecast."
    assert [(c.name, c.arguments) for c in after.tool_calls] == [
        (c.name, c.arguments) for c in alone.tool_calls
    ]
    assert after.reasoning is None and alone.reasoning == "Need forecast; call get_weather."
    events = PARSERS["openai"]().stream()
    assert collect(events.feed(content) + events.finish()).tool_calls[0].name == "get_weather"


def test_harmony_reasoning_tokens_leave_out_the_markup_tokens() -> None:
    parser = HarmonyReasoningParser()
    tokens = ["<|channel|>", "analysis", "<|message|>", "a", "b", "<|end|>", "<|start|>"]
    tokens += ["assistant", "<|channel|>", "final", "<|message|>", "c"]
    for token in tokens:
        parser.feed(token, 1)
    parser.flush()
    assert parser.reasoning_tokens == 2


def test_harmony_models_are_detected_from_the_vocabulary_or_the_template() -> None:
    vocab = {"<|channel|>": 200005, "<|message|>": 200008}
    assert detect_reasoning_markers(vocab, None) == HARMONY_MARKERS
    assert detect_reasoning_markers({}, "{{- '<|channel|>final<|message|>' }}") == HARMONY_MARKERS
