"""A client that goes away aborts its engine request, streaming or not.

The raw-ASGI tests drive the app with a ``receive`` that reports ``http.disconnect`` at a chosen
moment; the uvicorn tests close a real socket mid-response.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.runtime.engine.mock import MockEngine

LONG = {"prompt": "a", "max_tokens": 200, "stream": True}


def slow_engine() -> MockEngine:
    engine = MockEngine(reply="x" * 200, token_delay_s=0.01)
    engine.start()
    return engine


def http_scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("test", 1),
        "server": ("test", 80),
    }


class FakeConnection:
    """ASGI receive/send for one request whose client disconnects when ``gone`` is set."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = json.dumps(body).encode()
        self.body_sent = False
        self.gone = asyncio.Event()
        self.messages: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        chunks = [m for m in self.messages if m["type"] == "http.response.body" and m["body"]]
        if len(chunks) >= 3:
            self.gone.set()


async def test_streaming_disconnect_aborts_the_engine_request() -> None:
    engine = slow_engine()
    conn = FakeConnection(LONG)
    await asyncio.wait_for(
        create_app(engine)(http_scope("/v1/completions"), conn.receive, conn.send), 5
    )
    assert len(engine.aborted) == 1
    assert engine.aborted[0] == engine.requests[0].request_id
    bodies = [m for m in conn.messages if m["type"] == "http.response.body"]
    assert len(bodies) < 20  # stopped long before the 200 tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_before_first_token_or_during_json_aborts(stream: bool) -> None:
    engine = slow_engine()
    conn = FakeConnection({**LONG, "stream": stream})
    asyncio.get_running_loop().call_later(0.1, conn.gone.set)
    app = create_app(engine)
    if stream:
        engine.token_delay_s = 1.0  # still waiting for the first token when the client leaves
    await asyncio.wait_for(app(http_scope("/v1/completions"), conn.receive, conn.send), 5)
    assert engine.aborted == [engine.requests[0].request_id]
    start = next(m for m in conn.messages if m["type"] == "http.response.start")
    assert start["status"] == 499


@pytest.fixture
def served() -> Iterator[tuple[MockEngine, str]]:
    """A real uvicorn server on a free port, in a thread, serving a slow mock engine."""
    engine = MockEngine(reply="y" * 300, token_delay_s=0.01)
    config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        threading.Event().wait(0.01)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_uvicorn_streaming_client_closing_aborts(served: tuple[MockEngine, str]) -> None:
    engine, url = served
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = [line for _, line in zip(range(6), lines, strict=False)]
        assert seen[0].startswith("data: ")
    assert engine.wait_for_aborts(1, timeout_s=5)
    assert engine.aborted == [engine.requests[0].request_id]


def test_uvicorn_json_client_closing_aborts(served: tuple[MockEngine, str]) -> None:
    engine, url = served
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
        client.post(f"{url}/v1/chat/completions", json=body)  # gives up after 0.3 s of 3 s
    assert engine.wait_for_aborts(1, timeout_s=5)
    assert engine.aborted == [engine.requests[0].request_id]
