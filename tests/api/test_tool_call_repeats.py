"""A reply ends where the model repeats a tool call it already made (same name, same arguments):
the repeat is never sent, the reply finishes with ``tool_calls``, and the sequence is aborted.

The chat route runs over the real ``Engine`` with a scripted runner (``tests.api.stub_engine``),
so the tests see how far the engine generated and whether the pages came back.
``ToolCallPieces`` is also driven directly over scripted pieces for a forced (grammar) reply,
which the stub engine cannot constrain.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.generation.stream import TextPiece
from jax_llm_runtime.api.protocol.bodies import Usage
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.api.tool_calling.chat import ToolCallPieces
from jax_llm_runtime.api.tool_calling.parsers import JsonParser
from tests.api.conftest import sse_chunks
from tests.api.inprocess import app_client
from tests.api.stub_engine import ScriptedRunner, stub_engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def call(city: str) -> str:
    arguments = json.dumps({"city": city})
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>\n'


def weather(city: str) -> dict[str, str]:
    return {"name": "get_weather", "arguments": json.dumps({"city": city})}


async def chat(script: str, stream: bool, loop: bool = False, max_tokens: int = 400) -> Any:
    """The reply to ASK (content, calls, finish reason, usage), the scripted runner, the engine
    and the server's metrics, once the request's abort (if any) has reached the engine's loop."""
    runner = ScriptedRunner(0.001, script, loop)
    engine, _ = stub_engine(max_model_len=4096, num_pages=512, runner=runner)
    body: dict[str, Any] = {"messages": ASK, "tools": [WEATHER], "max_tokens": max_tokens}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    app = create_app(engine, config=ServerConfig(tool_parser="hermes"))
    async with app_client(app) as client:
        response = await asyncio.wait_for(client.post("/v1/chat/completions", json=body), 30)
        assert response.status_code == 200, response.text
        reply = streamed_reply(response.text) if stream else response.json()
        async with asyncio.timeout(5):
            while engine.num_unfinished():
                await asyncio.sleep(0.005)
        metrics = (await client.get("/metrics")).text
    return reply, runner, engine, metrics


def streamed_reply(body: str) -> dict[str, Any]:
    """A streamed reply reassembled as a client does, shaped like a non-streamed one."""
    chunks = sse_chunks(body)
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for item in delta.get("tool_calls", []):
                if "id" in item:
                    assert item["index"] not in calls, "a call index was announced twice"
                    calls[item["index"]] = {"id": item["id"], "function": dict(item["function"])}
                else:
                    calls[item["index"]]["function"]["arguments"] += item["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    message = {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
    choice = {"message": message, "finish_reason": finish}
    return {"id": chunks[0]["id"], "choices": [choice], "usage": chunks[-1]["usage"]}


def functions(reply: dict[str, Any]) -> list[dict[str, str]]:
    return [c["function"] for c in reply["choices"][0]["message"].get("tool_calls") or []]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_repeated_call_ends_the_reply(stream: bool) -> None:
    script = "Let me check." + call("Paris") + call("Paris") + "It is sunny."
    reply, _, engine, metrics = await chat(script, stream)
    choice = reply["choices"][0]
    assert functions(reply) == [weather("Paris")]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert 'success_total{finish_reason="tool_calls",model_name="stub-model"} 1.0' in metrics
    allocator = engine.scheduler.allocator
    assert allocator.num_free == allocator.num_pages


@pytest.mark.parametrize("stream", [False, True])
async def test_distinct_calls_all_come_through(stream: bool) -> None:
    # "Paris, TX" shares its start with "Paris": it is held, then sent once it differs.
    script = call("Paris") + call("Paris, TX") + call("Oslo") + call("Par")
    reply, *_ = await chat(script, stream)
    cities = ["Paris", "Paris, TX", "Oslo", "Par"]
    assert functions(reply) == [weather(city) for city in cities]
    assert reply["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_that_repeats_a_call_is_stopped_and_its_pages_freed(stream: bool) -> None:
    max_tokens = 3000
    reply, runner, engine, _ = await chat(call("Paris"), stream, loop=True, max_tokens=max_tokens)
    assert functions(reply) == [weather("Paris")]
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    # Generation stopped at the repeat, which is known at its closing brace (a few steps pass
    # before the abort reaches the engine's loop).
    one_call = len(call("Paris"))
    generated = runner.lengths[reply["id"]]
    assert one_call < generated < 2 * one_call + 200 < max_tokens, generated
    assert reply["usage"]["completion_tokens"] <= generated
    allocator = engine.scheduler.allocator
    assert allocator.num_free == allocator.num_pages


class ScriptedPieces:
    """A choice's pieces: ``texts`` one piece each, the last with ``finish_reason``; records
    whether it was closed (which aborts a real generation)."""

    def __init__(self, texts: list[str], finish_reason: str = "length") -> None:
        self.texts = texts
        self.finish_reason = finish_reason
        self.sent = 0
        self.closed = False

    async def pieces(self) -> AsyncIterator[TextPiece]:
        for i, text in enumerate(self.texts):
            self.sent += 1
            last = i + 1 == len(self.texts)
            usage = Usage(prompt_tokens=1, completion_tokens=i + 1, total_tokens=i + 2)
            yield TextPiece(text, self.finish_reason if last else None, usage)

    async def aclose(self) -> None:
        self.closed = True

    async def finish(self, reason: str) -> None:
        self.finish_reason = reason
        await self.aclose()


FORCED = json.dumps([{"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {"a": 2}}])
FORCED_REPEAT = FORCED[:-1] + ', {"name": "f", "arguments": {"a": 1}}' * 20 + "]"


@pytest.mark.parametrize("size", [1, 3, 7, len(FORCED_REPEAT)])
async def test_a_forced_reply_ends_at_the_repeat_however_the_text_is_cut(size: int) -> None:
    texts = [FORCED_REPEAT[i : i + size] for i in range(0, len(FORCED_REPEAT), size)]
    inner = ScriptedPieces(texts)
    pieces = ToolCallPieces(inner, JsonParser(), forced=True)
    reply = await pieces.collect()
    calls = [c["function"] for c in reply.tool_calls]
    assert calls == [{"name": "f", "arguments": '{"a": 1}'}, {"name": "f", "arguments": '{"a": 2}'}]
    assert reply.finish_reason == "tool_calls" and reply.text == ""
    if size < len(FORCED_REPEAT):
        assert inner.closed and inner.sent < len(texts)


async def test_a_reply_without_repeats_is_not_cut() -> None:
    inner = ScriptedPieces(list(FORCED), finish_reason="stop")
    reply = await ToolCallPieces(inner, JsonParser(), forced=True).collect()
    arguments = [json.loads(c["function"]["arguments"]) for c in reply.tool_calls]
    assert arguments == [{"a": 1}, {"a": 2}]
    assert reply.finish_reason == "tool_calls" and not inner.closed
