"""POST /v1/responses over the mock engine, whose replies are scripted per turn, with the calc MCP
server (``tests/mcp_calc_server.py``) connected: MCP calls run between turns, client functions
end the response, conversations continue through ``previous_response_id``, and the official
``openai`` SDK reads both the JSON and the streamed responses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import assert_error
from tests.api.inprocess import serve_in_thread
from tests.api.mcp_helpers import calc_server, hermes_call

MAX_ROUNDS = 2
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, MockEngine]]:
    engine = MockEngine(max_model_len=16384, token_delay_s=0)
    config = ServerConfig(
        tool_parser="hermes", mcp_servers=(calc_server(),), mcp_max_rounds=MAX_ROUNDS
    )
    with serve_in_thread(create_app(engine, config=config)) as url:
        yield url, engine


@pytest.fixture
def engine(server: tuple[str, MockEngine]) -> Iterator[MockEngine]:
    _, engine = server
    engine.replies.clear()
    yield engine
    assert not engine.replies, "a scripted reply was not used"


@pytest.fixture
def client(server: tuple[str, MockEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: tuple[str, MockEngine], **body: Any) -> httpx.Response:
    return httpx.post(f"{server[0]}/v1/responses", json=body, timeout=60)


def prompts(engine: MockEngine, count: int) -> list[str]:
    """The text of the last ``count`` prompts the engine received."""
    return [engine.tokenizer.decode(r.prompt_token_ids) for r in engine.requests[-count:]]


def test_an_mcp_call_runs_and_the_next_turn_answers(
    client: openai.OpenAI, engine: MockEngine
) -> None:
    engine.replies.extend([hermes_call("calc__add", a=2, b=3), "The sum is 5."])
    before = len(engine.requests)
    response = client.responses.create(model="mock-model", input="What is 2 + 3?")
    assert len(engine.requests) == before + 2
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == "The sum is 5."
    call, message = response.output
    assert call.type == "mcp_call" and (call.server_label, call.name) == ("calc", "add")
    assert json.loads(call.arguments) == {"a": 2, "b": 3}
    assert call.output == "5" and call.status == "completed" and call.error is None
    assert message.type == "message" and message.content[0].text == "The sum is 5."
    first, second = prompts(engine, 2)
    assert '"name": "calc__add"' in first
    assert second.startswith(first) and second.endswith(
        "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )
    usage = response.usage
    assert usage.input_tokens == len(engine.requests[-1].prompt_token_ids) + len(
        engine.requests[-2].prompt_token_ids
    )
    assert usage.output_tokens > len("The sum is 5.")
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_the_stream_carries_the_call_and_the_answer(
    client: openai.OpenAI, engine: MockEngine
) -> None:
    engine.replies.extend([hermes_call("calc__add", a=20, b=22), "It is 42."])
    events = list(client.responses.create(model="mock-model", input="20 + 22?", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["mcp_call", "message"]
    assert "response.mcp_call.completed" in kinds
    assert kinds.index("response.mcp_call.completed") < kinds.index("response.output_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "It is 42."
    arguments = "".join(e.delta for e in events if e.type == "response.mcp_call_arguments.delta")
    assert json.loads(arguments) == {"a": 20, "b": 22}
    final = events[-1].response
    assert final.output_text == "It is 42." and final.output[0].output == "42"


def test_the_sdk_stream_helper_builds_the_final_response(
    client: openai.OpenAI, engine: MockEngine
) -> None:
    engine.replies.extend([hermes_call("calc__echo", text="hi"), "Echoed."])
    with client.responses.stream(model="mock-model", input="echo hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Echoed." and final.output_text == "Echoed."
    assert [item.type for item in final.output] == ["mcp_call", "message"]


def test_a_client_function_call_ends_the_response(
    client: openai.OpenAI, engine: MockEngine, tmp_path: Path
) -> None:
    engine.replies.append(hermes_call("get_weather", city="Paris"))
    before = len(engine.requests)
    response = client.responses.create(
        model="mock-model", input="Weather in Paris?", tools=[WEATHER]
    )
    assert len(engine.requests) == before + 1
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"city": "Paris"}
    assert response.status == "completed" and response.output_text == ""
    (prompt,) = prompts(engine, 1)
    assert '"name": "get_weather"' in prompt and "calc__" not in prompt

    engine.replies.append("It is sunny in Paris.")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    answer = client.responses.create(
        model="mock-model", input=[output], previous_response_id=response.id, tools=[WEATHER]
    )
    assert answer.output_text == "It is sunny in Paris."
    assert answer.previous_response_id == response.id
    (prompt,) = prompts(engine, 1)
    assert "Weather in Paris?" in prompt and "<|im_start|>tool\nsunny, 21 C<|im_end|>" in prompt


def test_streamed_function_call_arguments(
    server: tuple[str, MockEngine], engine: MockEngine
) -> None:
    engine.replies.append(hermes_call("get_weather", city="Oslo"))
    response = post(server, input="Weather in Oslo?", tools=[WEATHER], stream=True)
    assert response.status_code == 200
    events = []
    for block in response.text.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        events.append(event)
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert json.loads("".join(e["delta"] for e in deltas)) == {"city": "Oslo"}
    assert done["arguments"] == "".join(e["delta"] for e in deltas)
    assert done["name"] == "get_weather"
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["type"] == "function_call"


def test_previous_response_id_continues_the_conversation(
    client: openai.OpenAI, engine: MockEngine
) -> None:
    engine.replies.extend(["Hello, Ada.", "Your name is Ada."])
    first = client.responses.create(
        model="mock-model", input="My name is Ada.", instructions="Be brief.", tools=[]
    )
    second = client.responses.create(
        model="mock-model", input="What is my name?", previous_response_id=first.id, tools=[]
    )
    assert second.output_text == "Your name is Ada."
    first_prompt, second_prompt = prompts(engine, 2)
    assert first_prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "Be brief." not in second_prompt  # instructions are not carried over
    assert "My name is Ada.<|im_end|>" in second_prompt
    assert "<|im_start|>assistant\nHello, Ada.<|im_end|>" in second_prompt


def test_an_unknown_or_unstored_previous_response_is_a_400(
    client: openai.OpenAI, server: tuple[str, MockEngine], engine: MockEngine
) -> None:
    error = assert_error(post(server, input="hi", previous_response_id="resp_nope"), 400)
    assert error["param"] == "previous_response_id"
    assert error["code"] == "previous_response_not_found"
    engine.replies.append("Not kept.")
    unstored = client.responses.create(model="mock-model", input="hi", store=False, tools=[])
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="mock-model", input="hi", previous_response_id=unstored.id)
    assert caught.value.code == "previous_response_not_found"


def test_a_failed_mcp_call_is_reported_and_told_to_the_model(
    client: openai.OpenAI, engine: MockEngine
) -> None:
    engine.replies.extend([hermes_call("calc__fail", reason="disk full"), "It failed."])
    response = client.responses.create(model="mock-model", input="Try it.")
    call, _ = response.output
    assert call.status == "failed" and call.output is None
    assert call.error.type == "mcp_tool_execution_error"
    (prompt,) = prompts(engine, 1)
    assert "<|im_start|>tool\nError executing tool fail: disk full<|im_end|>" in prompt


def test_after_the_last_round_the_model_answers_without_tools(
    client: openai.OpenAI, engine: MockEngine
) -> None:
    calls = [hermes_call("calc__add", a=i, b=i) for i in range(MAX_ROUNDS)]
    engine.replies.extend([*calls, "Done adding."])
    response = client.responses.create(model="mock-model", input="Add a lot.")
    assert [item.type for item in response.output] == [*["mcp_call"] * MAX_ROUNDS, "message"]
    assert [item.output for item in response.output[:-1]] == ["0", "2"]
    *earlier, last = prompts(engine, MAX_ROUNDS + 1)
    assert all('"name": "calc__add"' in prompt for prompt in earlier)
    assert "calc__add" not in last.split("<|im_start|>user")[0]  # no tools listed any more


def test_max_output_tokens_ends_an_incomplete_response(
    client: openai.OpenAI, engine: MockEngine
) -> None:
    engine.replies.append("The sum is 5.")
    response = client.responses.create(
        model="mock-model", input="2 + 3?", max_output_tokens=4, tools=[]
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "The " and response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 4


def test_mcp_tools_are_called_only_when_the_request_sent_no_tools(
    client: openai.OpenAI, engine: MockEngine, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    engine.replies.append(hermes_call("calc__touch", path=str(marker)))
    response = client.responses.create(model="mock-model", input="Touch it.", tools=[WEATHER])
    assert response.output[0].type == "function_call" and not marker.exists()
    engine.replies.extend([hermes_call("calc__touch", path=str(marker)), "Touched."])
    response = client.responses.create(model="mock-model", input="Touch it.")
    assert response.output[0].type == "mcp_call" and marker.exists()


def test_input_items_become_the_conversation(client: openai.OpenAI, engine: MockEngine) -> None:
    engine.replies.append("Fine.")
    items = [
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "It is 21 C.", "annotations": []}],
        },
        {"role": "user", "content": "Thanks"},
    ]
    client.responses.create(model="mock-model", input=items, tools=[WEATHER])
    (prompt,) = prompts(engine, 1)
    expected = (
        "<|im_start|>system\nUse metric units.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n21 C<|im_end|>\n"
        "<|im_start|>assistant\nIt is 21 C.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
    )
    assert expected in prompt


def test_max_output_tokens_beyond_the_context_is_lowered_to_the_room_left(
    client: openai.OpenAI, engine: MockEngine
) -> None:
    engine.replies.append("The sum is 5.")
    response = client.responses.create(
        model="mock-model", input="2 + 3?", max_output_tokens=100000, tools=[]
    )
    assert response.status == "completed" and response.output_text == "The sum is 5."


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": "hi", "bogus": 1}]}, "input[0].bogus"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "temperature": -1}, "temperature"),
        ({"input": []}, "input"),
        ({"instructions": "x"}, "input"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    server: tuple[str, MockEngine], engine: MockEngine, body: dict[str, Any], param: str
) -> None:
    assert_error(post(server, **body), 400, param=param)


def test_another_model_name_is_answered_by_the_one_served(
    server: tuple[str, MockEngine], engine: MockEngine
) -> None:
    response = post(server, model="gpt-x", input="hi")
    assert response.status_code == 200 and response.json()["model"] == "mock-model"
