"""``runtime-serve`` with the embedded default model, driven by the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve_process import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


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
