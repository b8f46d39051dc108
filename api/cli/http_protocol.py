"""uvicorn's h11 protocol with deadlines for reading requests and writing responses, and errors
in the envelope.

1. uvicorn closes a keep-alive connection that stays idle after a response, but nothing bounds a
   request that is still arriving: a client that opens a connection and sends nothing, or sends
   its head or body a byte a second, holds the connection (and its request's buffers) for as long
   as it likes. Here each request's head and body together must arrive within ``read_timeout_s``
   of its first byte (of the connection's opening, for the first request). Past that the client
   gets a 408 envelope (or, when its request was already answered, nothing) and the connection is
   closed; a route still waiting for the body sees a disconnect (``api.service.disconnect``).
2. A client that stops reading its response (a stream it never reads, a reader stuck behind a
   full receive window) makes uvicorn's ``send`` wait, with no bound, once the transport's write
   buffer passes asyncio's 64 KiB high-water mark, until it drains below 16 KiB. Meanwhile the
   engine keeps generating into the request's queue (``runtime.engine.core``). Here,
   once the transport pauses writing, the client has ``write_timeout_s`` to take enough bytes to
   resume it (nginx's ``send_timeout``); past that the connection is aborted (``abort``, not
   ``close``, which would wait for the unsent bytes forever) with one log line. uvicorn then
   reports a disconnect, so a streaming route's engine request is aborted and its pages freed
   (``api.generation.sse``), and nothing of the response stays buffered. 0 disables it.
3. Bytes that are not HTTP (a garbage request line, a malformed chunk, a bad Content-Length)
   get uvicorn's 400 and a closed connection, but with the OpenAI envelope instead of plain text.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from jax_llm_runtime.api.protocol.errors import APIError

logger = logging.getLogger(__name__)


def _envelope_response(status: int, reason: bytes, error: APIError) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written without h11 (which allows
    no response before a request head has arrived)."""
    body = msgspec.json.encode(error.body())
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, reason, len(body))
    )
    return head + body


class TimeoutH11Protocol(H11Protocol):
    """``H11Protocol`` with a per-request read deadline and a write-stall deadline;
    ``timeout_protocol`` sets them."""

    read_timeout_s: float = 60.0
    write_timeout_s: float = 30.0  # 0: a client may leave its response unread for ever

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_timeout_s and self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start reading a pipelined request
        self._follow_request()

    def send_400_response(self, msg: str) -> None:
        error = APIError(400, msg, code="invalid_http_request")
        self.transport.write(_envelope_response(400, b"Bad Request", error))
        self.transport.close()

    def _follow_request(self) -> None:
        """The deadline runs while part of a request is in and the rest is not."""
        state = self.conn.their_state
        started = state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0])
        if not started or self.transport.is_closing():
            self._cancel_read_timer()
        elif self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        cycle = self.cycle
        response, outcome = "its response", ""
        if cycle is not None:
            response = f"its response to {cycle.scope['method']} {cycle.scope['path']}"
            if not cycle.response_complete:
                outcome = "; the request is aborted"
        logger.warning(
            "closing the connection of %s, which has not read %s for %gs (%d bytes unsent)%s",
            f"{self.client[0]}:{self.client[1]}" if self.client else "a client",
            response,
            self.write_timeout_s,
            self.transport.get_write_buffer_size(),
            outcome,
        )
        self.transport.abort()  # connection_lost follows: a streaming route sees a disconnect

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        reading_body = self.conn.their_state is not h11.IDLE and self.cycle is not None
        answered = reading_body and self.cycle.response_started
        if not answered:
            message = (
                f"The request did not arrive within {self.read_timeout_s:g}s; "
                "the connection is closed."
            )
            error = APIError(408, message, code="request_timeout")
            self.transport.write(_envelope_response(408, b"Request Timeout", error))
        logger.info(
            "closing a connection whose request took over %gs to arrive", self.read_timeout_s
        )
        self.transport.close()


def timeout_protocol(read_timeout_s: float, write_timeout_s: float) -> type[TimeoutH11Protocol]:
    """The protocol class to hand uvicorn (``uvicorn.Config(http=...)``) for these deadlines."""
    deadlines = {"read_timeout_s": read_timeout_s, "write_timeout_s": write_timeout_s}
    return type("TimeoutH11Protocol", (TimeoutH11Protocol,), deadlines)
