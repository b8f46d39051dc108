"""``runtime-serve`` with the embedded default model, driven by the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve_process import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The default model's greedy answer, "The capital city of France is Paris.", leads its runner-up
# by 0.7 nats or more at every token, with int8 or float operands: it holds across CPUs.
# ("Which city is the capital of France?" turned on a last-bit difference: "Paris" on AMD EPYCs,
# "Le Grand Chateau ..." on a Xeon, from llama.cpp too.)
QUESTION = [{"role": "user", "content": "Name the capital city of France."}]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(["--max-model-len", "512", "--max-num-seqs", "4"], log) as proc:
        assert proc.model == "smollm2-135m-instruct"
        yield proc.url
    assert "Traceback" not in log.read_text()


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, messages: list[dict], **kw) -> openai.types.chat.ChatCompletion:
    kw = {"temperature": 0, "max_tokens": 48, **kw}
    return client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, **kw)


def test_non_streaming_chat(client: openai.OpenAI) -> None:
    reply = ask(client, QUESTION)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    usage = reply.usage
    assert usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 48
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streaming_equals_non_streaming_at_temperature_zero(client: openai.OpenAI) -> None:
    expected = ask(client, QUESTION).choices[0].message.content
    chunks = list(ask(client, QUESTION, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_length_limit_reports_length(client: openai.OpenAI) -> None:
    reply = ask(
        client, [{"role": "user", "content": "Write a long story about a dragon."}], max_tokens=5
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5


def test_concurrent_requests_are_batched_and_match_solo_answers(client: openai.OpenAI) -> None:
    questions = [
        [{"role": "user", "content": "Name three colours."}],
        [{"role": "user", "content": "What is 2 plus 2?"}],
    ]
    solo = [ask(client, q).choices[0].message.content for q in questions]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda q: ask(client, q).choices[0].message.content, questions))
    assert together == solo


def test_malformed_requests_are_400_with_the_envelope(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user"}], max_tokens=4
        )
    assert err.value.status_code == 400
    assert set(err.value.body) >= {"message", "type", "param", "code"}
    raw = httpx.post(f"{server}/chat/completions", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and set(raw.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


def test_completions_models_and_health(client: openai.OpenAI, server: str) -> None:
    text = client.completions.create(
        model="smollm2-135m-instruct",
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
    )
    assert text.choices[0].text and text.usage.completion_tokens <= 8
    assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"]
    assert httpx.get(server.removesuffix("/v1") + "/health", timeout=10).status_code == 200


def test_a_repeated_prompt_reports_cached_tokens_and_the_same_answer(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You answer questions about gardening in one sentence. " * 4},
        {"role": "user", "content": "When should I plant tulip bulbs?"},
    ]
    first, second = ask(client, messages), ask(client, messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and first.usage.prompt_tokens - 16 <= cached < first.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
WEATHER_QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")],
)
def test_a_forced_tool_call_is_a_valid_call(client: openai.OpenAI, tool_choice, expected) -> None:
    import jsonschema

    reply = ask(client, WEATHER_QUESTION, tools=WEATHER_TOOLS, tool_choice=tool_choice)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER_TOOLS}
    assert call.function.name in schemas and (expected is None or call.function.name == expected)
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_forced_call_the_model_repeats_ends_the_reply(client: openai.OpenAI) -> None:
    """With room for many calls, this model writes the same call again and again: the reply
    carries it once and ends with "tool_calls" long before the budget."""
    reply = ask(
        client, WEATHER_QUESTION, tools=WEATHER_TOOLS, tool_choice="required", max_tokens=400
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(calls) == len(set(calls)) >= 1
    assert reply.usage.completion_tokens < 100


@pytest.mark.parametrize("max_tokens", [6, 12])
def test_a_forced_call_cut_off_by_max_tokens_leaks_no_markup(
    client: openai.OpenAI, max_tokens: int
) -> None:
    reply = ask(
        client, WEATHER_QUESTION, tools=WEATHER_TOOLS, tool_choice="required", max_tokens=max_tokens
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content, choice.message.content
    for call in choice.message.tool_calls or []:  # only whole calls come back
        json.loads(call.function.arguments)


def test_a_forced_tool_call_streams_name_then_arguments(client: openai.OpenAI) -> None:
    chunks = list(
        ask(client, WEATHER_QUESTION, tools=WEATHER_TOOLS, tool_choice="required", stream=True)
    )
    items = [i for c in chunks if c.choices for i in c.choices[0].delta.tool_calls or []]
    assert items[0].id and items[0].function.name in ("get_weather", "get_time")
    assert all(i.index == 0 and i.id is None for i in items[1:])
    arguments = "".join(i.function.arguments or "" for i in items)
    assert json.loads(arguments)["city"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_tool_result_in_the_history_gets_an_answer(client: openai.OpenAI) -> None:
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"sky": "sunny", "c": 21}'},
    ]
    reply = ask(client, messages, tools=WEATHER_TOOLS, max_tokens=24)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Lima", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_json_schema_output_validates_for_20_seeds(client: openai.OpenAI) -> None:
    import jsonschema

    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    messages = [{"role": "user", "content": "Describe a person as JSON."}]

    def one(seed: int) -> str:
        reply = ask(
            client, messages, temperature=1.0, seed=seed, max_tokens=80,
            response_format=response_format,
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, range(20)))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1
