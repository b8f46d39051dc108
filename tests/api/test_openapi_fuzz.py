"""The OpenAPI document describes the real bodies, and schemathesis fuzzes the app over a socket.

The app runs under uvicorn on a free port of 127.0.0.1 in a thread, with the mock engine, so the
run (``tests.openapi_fuzz``: coverage cases plus positive and negative generated cases for every
operation) sends well over a thousand requests in well under a minute. No response may be a 5xx,
every error must be the OpenAI envelope, the server must log no error (a stream that fails after
its first byte is still a 200), and afterwards it must be healthy and answer a plain chat.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import requests

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.protocol.bodies import (
    MAX_MESSAGES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
)
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import MAX_MODEL_LEN
from tests.api.inprocess import serve_in_thread
from tests.openapi_fuzz import run_fuzz

MAX_EXAMPLES = 120  # per operation and mode; with the coverage cases over 2,000 requests
MIN_REQUESTS = 1000
BODY_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
HELLO = {"messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, MockEngine]]:
    """The app with the mock engine, served by uvicorn in a thread; its base URL and engine."""
    engine = MockEngine(model_name="mock-model", max_model_len=MAX_MODEL_LEN, token_delay_s=0)
    with serve_in_thread(create_app(engine)) as url:
        yield url, engine


def test_the_document_describes_request_bodies_and_the_error_envelope(
    server: tuple[str, MockEngine],
) -> None:
    base_url, _ = server
    document = requests.get(f"{base_url}/schema/openapi.json", timeout=30).json()
    for path in (*BODY_ROUTES, "/tokenize", "/detokenize"):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["type"] == "object" and body["schema"]["properties"], path
    chat = document["paths"]["/v1/chat/completions"]["post"]
    fields = chat["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert "messages" in chat["requestBody"]["content"]["application/json"]["schema"]["required"]
    assert fields["messages"]["maxItems"] == MAX_MESSAGES
    stop_list = next(s for s in fields["stop"]["anyOf"] if s.get("type") == "array")
    assert stop_list["maxItems"] == MAX_STOP_STRINGS
    assert stop_list["items"]["maxLength"] == MAX_STOP_STRING_CHARS
    tools = next(s for s in fields["tools"]["anyOf"] if s.get("type") == "array")
    assert tools["maxItems"] == MAX_TOOLS
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            error = operation["responses"]["default"]["content"]["application/json"]["schema"]
            envelope = error["properties"]["error"]
            assert set(envelope["required"]) == {"message", "type", "param", "code"}, (path, method)


def test_fuzzed_requests_get_no_5xx_and_errors_keep_the_envelope(
    server: tuple[str, MockEngine], caplog: pytest.LogCaptureFixture
) -> None:
    base_url, engine = server
    caplog.set_level(logging.ERROR)
    log = run_fuzz(base_url, MAX_EXAMPLES, timeout_s=30)
    assert log.requests >= MIN_REQUESTS, sorted(log.statuses.items())
    assert not log.failures, log.report()
    # The generated data reaches past validation (a 200) and is also refused (a 400) on every
    # body route, so it is neither all rejected nor all accepted.
    for path in BODY_ROUTES:
        assert {200, 400} <= log.codes(f"POST {path}"), (path, sorted(log.statuses.items()))
    server_errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not server_errors, [r.getMessage() for r in server_errors[:10]]

    assert requests.get(f"{base_url}/health", timeout=30).status_code == 200
    reply = requests.post(f"{base_url}/v1/chat/completions", json=HELLO, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "olleh"
    assert engine.healthy()
