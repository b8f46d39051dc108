"""Per-request sampling fields and logprobs through the HTTP layer, on the mock engine.

The mock answers a chat with the last user message reversed, one byte token per delta, and gives
each token logprob -0.5 with alternatives token+1, token+2, ... at -1.5, -2.5, ...
"""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import TestClient

from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import assert_error, sse_chunks

Client = TestClient[Any]
HELLO = [{"role": "user", "content": "hello"}]


def chat(client: Client, **fields: Any) -> Any:
    return client.post("/v1/chat/completions", json={"messages": HELLO, **fields})


def test_sampling_fields_reach_the_engine(client: Client, engine: MockEngine) -> None:
    response = chat(
        client,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        repeat_last_n=32,
        min_p=0.1,
        min_tokens=2,
        logit_bias={"5": -100, "7": 3.5},
        max_tokens=10,
    )
    assert response.status_code == 200, response.text
    sp = engine.requests[0].sampling
    assert (sp.seed, sp.presence_penalty, sp.frequency_penalty) == (7, 0.5, -0.5)
    assert (sp.repetition_penalty, sp.repeat_last_n, sp.min_p, sp.min_tokens) == (1.2, 32, 0.1, 2)
    assert sp.logit_bias == ((5, -100.0), (7, 3.5)) and sp.logprobs is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repeat_last_n": 5000}, "repeat_last_n"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"258": 1}}, "logit_bias"),  # outside the mock's vocabulary
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ],
)
def test_bad_sampling_fields_are_400_naming_the_field(
    client: Client, fields: dict[str, Any], param: str
) -> None:
    assert_error(chat(client, **fields), 400, param=param)


def test_chat_logprobs_json(client: Client) -> None:
    response = chat(client, logprobs=True, top_logprobs=2)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "olleh"
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content[:5]) == "olleh"
    first = content[0]
    assert first == {
        "token": "o",
        "logprob": -0.5,
        "bytes": [ord("o")],
        "top_logprobs": [
            {"token": "o", "logprob": -0.5, "bytes": [ord("o")]},
            {"token": "p", "logprob": -1.5, "bytes": [ord("p")]},
        ],
    }


def test_chat_without_logprobs_has_null_logprobs(client: Client) -> None:
    assert chat(client).json()["choices"][0]["logprobs"] is None


def test_chat_stream_logprobs_follow_the_text(client: Client) -> None:
    response = chat(client, logprobs=True, stream=True)
    chunks = sse_chunks(response.text)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    tokens = [
        entry["token"]
        for c in chunks
        if c["choices"][0]["logprobs"] is not None
        for entry in c["choices"][0]["logprobs"]["content"]
    ]
    assert text == "olleh"
    assert "".join(tokens[:5]) == "olleh"
    for c in chunks:
        content = c["choices"][0]["delta"].get("content")
        if content:
            assert [e["token"] for e in c["choices"][0]["logprobs"]["content"]] == list(content)


def test_stop_string_cut_drops_the_logprobs_of_cut_tokens(client: Client) -> None:
    response = chat(client, logprobs=True, stop=["le"])
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "ol"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["o", "l"]


def test_completion_logprobs_format(client: Client) -> None:
    body = {"prompt": "abc", "logprobs": 1, "max_tokens": 3}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == "cba"
    assert choice["logprobs"] == {
        "tokens": ["c", "b", "a"],
        "token_logprobs": [-0.5, -0.5, -0.5],
        "top_logprobs": [{"c": -0.5}, {"b": -0.5}, {"a": -0.5}],
        "text_offset": [0, 1, 2],
    }


def test_completion_stream_text_offsets_continue(client: Client) -> None:
    body = {"prompt": "abc", "logprobs": 0, "max_tokens": 3, "stream": True}
    chunks = sse_chunks(client.post("/v1/completions", json=body).text)
    offsets = [
        offset
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for offset in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == [0, 1, 2]
