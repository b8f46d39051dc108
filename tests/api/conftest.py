"""Fixtures for API tests: a mock engine and a Litestar test client serving it (lifespan run)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.runtime.engine.mock import MockEngine

MAX_MODEL_LEN = 256


@pytest.fixture
def engine() -> MockEngine:
    return MockEngine(model_name="mock-model", max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def client(engine: MockEngine) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(engine)) as test_client:
        yield test_client


def sse_data(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order; asserts the OpenAI ``\\n\\n`` framing."""
    assert body.endswith("\n\n"), body[-50:]
    events = body.split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: "), event
    return [event[len("data: ") :] for event in events]


def sse_chunks(body: str) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body, checking it ends with ``data: [DONE]``."""
    data = sse_data(body)
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def assert_error(
    response: Any, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Assert an OpenAI error envelope with this status (and param/code when given)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error
