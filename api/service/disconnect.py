"""Stop work for clients that have gone away.

Litestar's streaming response already listens for ``http.disconnect`` and cancels the task that
iterates the body. Plain handlers get no such help, so ``cancel_on_disconnect`` races an awaitable
(waiting for the first token, or collecting a whole non-streamed completion) against the ASGI
``receive`` channel, which yields ``http.disconnect`` once the request body has been read and the
client closes its connection. Cancelling the awaitable raises ``CancelledError`` inside the engine's
delta stream, which aborts the request and frees its pages. ``read_body`` turns a client that goes
away while it sends the body (or is cut off by ``--request-read-timeout``) into the same 499.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from litestar import Request
from litestar.exceptions import InternalServerException

from jax_llm_runtime.api.protocol.errors import APIError

T = TypeVar("T")

# nginx's "client closed request": never seen by the client, but visible in access logs.
CLIENT_CLOSED_REQUEST = 499


class ClientDisconnectedError(APIError):
    """The client closed the connection before the response was ready."""

    def __init__(self) -> None:
        super().__init__(
            CLIENT_CLOSED_REQUEST,
            "The client closed the connection; the request was aborted.",
            code="client_disconnected",
        )


async def read_body(request: Request[Any, Any, Any]) -> bytes:
    """The request body; a client that closes the connection before all of it has arrived is a
    ClientDisconnectedError, not a server error.

    Litestar raises ``InternalServerException`` ("client disconnected prematurely") for an
    ``http.disconnect`` while it reads the body; that is the only one its body reader raises (a
    body past the cap is a ``RequestEntityTooLarge``, a 413).
    """
    try:
        return await request.body()
    except InternalServerException:
        raise ClientDisconnectedError() from None


async def _wait_for_disconnect(request: Request[Any, Any, Any]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request[Any, Any, Any], work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnectedError.

    Call only after the request body has been read (otherwise body messages would be consumed).
    ``work`` is cancelled and awaited before this returns or raises, so any async generator it was
    iterating has finished by then.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
        # Let both tasks unwind (closing the engine stream) before deciding what happened.
        await asyncio.wait({work_task, watch_task})
    if work_task.cancelled():
        raise ClientDisconnectedError()
    return work_task.result()
