"""A client that never reads its stream is cut off (``--response-write-timeout``).

A raw socket with a small receive buffer asks for a long streamed completion and reads nothing.
uvicorn's transport stops writing to it once its buffer passes the high-water mark; after the
write timeout the server closes the connection and aborts the engine request, while another
client is served as usual. The server is configured exactly as ``runtime-serve`` configures it
(``api.cli.server.uvicorn_config``), on the mock engine.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import pytest

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.cli.server import uvicorn_config
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.inprocess import serve_config_in_thread

T = TypeVar("T")

WRITE_TIMEOUT_S = 1.0
MAX_TOKENS = 200_000  # far more than the socket buffers hold: the client must stall the stream
HIGH_WATER = 64 * 1024  # asyncio's default high-water mark for a transport's write buffer
EVENT_BYTES = 1024  # more than one SSE chunk of the mock's one-byte tokens
DEADLINE_S = 30.0  # generous: the abort comes about WRITE_TIMEOUT_S after the stall


def wait_for(probe: Callable[[], T | None], what: str) -> T:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = probe()
        if value is not None and value is not False:
            return value
        time.sleep(0.01)
    raise AssertionError(f"not within {DEADLINE_S}s: {what}")


def stalled_client(port: int) -> socket.socket:
    """A client that sends a long streamed completion request and never reads a byte."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {"prompt": "a", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}
    ).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    sock.sendall(head + body)
    return sock


def paused_protocol(server: Any) -> Any:
    """The connection whose transport stopped writing (its write buffer past high water)."""
    for protocol in list(server.server_state.connections):
        flow = getattr(protocol, "flow", None)
        if flow is not None and flow.write_paused:
            return protocol
    return None


def read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(DEADLINE_S)
    received = bytearray()
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:  # abort() resets the connection
        pass
    return bytes(received)


def test_a_client_that_never_reads_its_stream_is_cut_off_and_others_are_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="jax_llm_runtime.api.cli.http_protocol")
    engine = MockEngine(reply="z" * 50, token_delay_s=0, max_model_len=MAX_TOKENS + 64)
    settings = ServerConfig(response_write_timeout_s=WRITE_TIMEOUT_S)
    app = create_app(engine, config=settings)
    with serve_config_in_thread(uvicorn_config(app, "127.0.0.1", 0, settings)) as server:
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        sock = stalled_client(port)
        try:
            protocol = wait_for(lambda: paused_protocol(server), "the stalled stream pauses")
            transport = protocol.transport
            peak = transport.get_write_buffer_size()  # past the high-water mark: it paused
            with httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
                other = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
            assert other.status_code == 200, other.text
            assert other.json()["choices"][0]["text"] == "zzzzz"

            # Until the abort, the unsent bytes stay at the transport's high-water mark.
            deadline = time.monotonic() + DEADLINE_S
            while not engine.aborted and time.monotonic() < deadline:
                peak = max(peak, transport.get_write_buffer_size())
                time.sleep(0.005)
            assert engine.aborted == [engine.requests[0].request_id]
            assert peak <= HIGH_WATER + EVENT_BYTES
            wait_for(lambda: engine.stats().num_running == 0, "no stream runs")

            received = read_until_closed(sock)
        finally:
            sock.close()
        assert b"HTTP/1.1 200" in received[:100]
        assert b"[DONE]" not in received  # cut off long before its 200,000 tokens
        assert received.count(b"data: ") < MAX_TOKENS // 4
        assert "has not read its response to POST /v1/completions for 1s" in caplog.text
        assert "the request is aborted" in caplog.text

        with httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
            after = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == "zzz"
    assert engine.aborted == [engine.requests[0].request_id]
