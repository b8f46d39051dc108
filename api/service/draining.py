"""Graceful shutdown: stop admitting requests, let those in flight finish, then abort the rest.

1. ``DrainMiddleware`` wraps every route and counts the requests in flight. Once ``Drain.start``
   was called it answers new requests with a 503 envelope (``Retry-After``, ``Connection:
   close``), except ``/health``, which then reports 503 itself so load balancers stop sending
   traffic, and ``/metrics``.
2. ``Drain.run(engine, timeout_s)`` starts draining and waits until no request is in flight, or
   ``timeout_s`` passed. Then it shuts the engine down: every unfinished sequence ends with
   ``abort``, which the routes send as a 503 envelope (JSON) or an error event and ``[DONE]``
   (SSE), and it waits up to ``ABORT_FLUSH_S`` for those responses to go out.
3. ``api.cli.server`` runs it on SIGTERM (a second SIGTERM calls ``stop_waiting``), then lets uvicorn
   close the socket; the app's lifespan awaits the same engine shutdown (``shutdown_engine`` runs
   it once) and the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import msgspec
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

from jax_llm_runtime.api.protocol.errors import APIError

logger = logging.getLogger(__name__)

ABORT_FLUSH_S = 2.0  # for aborted responses to reach their clients
RETRY_AFTER_S = 1  # the Retry-After of every 503 that asks the client to come back
PASS_WHILE_DRAINING = frozenset({"/health", "/metrics"})
_POLL_S = 0.05


class Stoppable(Protocol):
    """An engine, or the app's ``ModelRegistry`` (which stops all of its engines)."""

    def shutdown(self) -> None:
        """Stop; unfinished requests end with finish_reason ``abort``."""
        ...


class Drain:
    """Whether the server drains, and how many requests are in flight. One per app; every
    method runs on the app's event loop."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._hurry = False
        self._engine_stopped: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Refuse new requests from now on (``/health`` and ``/metrics`` still answer)."""
        self.draining = True

    def stop_waiting(self) -> None:
        """End the current wait for requests in flight now (safe from a signal handler)."""
        self._hurry = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False when ``timeout_s`` passed first (or
        ``stop_waiting`` was called)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight and not self._hurry and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        self._hurry = False
        return not self.in_flight

    async def shutdown_engine(self, engine: Stoppable) -> None:
        """``engine.shutdown()`` in a worker thread, once: a second call (the app's lifespan
        after a drain) waits for the first instead of racing it."""
        if self._engine_stopped is None:
            self._engine_stopped = asyncio.ensure_future(asyncio.to_thread(engine.shutdown))
        await asyncio.shield(self._engine_stopped)

    async def run(self, engine: Stoppable, timeout_s: float) -> bool:
        """Drain: refuse new requests, give those in flight ``timeout_s`` to finish, then shut
        the engine down so that the rest end with an error. True when none had to be aborted."""
        self.start()
        logger.info("draining: %d requests in flight, waiting up to %gs", self.in_flight, timeout_s)
        if await self.wait_idle(timeout_s):
            logger.info("drained: no request in flight")
            return True
        logger.warning("shutdown timeout: aborting the %d requests in flight", self.in_flight)
        await self.shutdown_engine(engine)
        if not await self.wait_idle(ABORT_FLUSH_S):
            logger.warning("%d aborted responses are still being sent", self.in_flight)
        return False


def retry_later_headers() -> dict[str, str]:
    """Headers of a 503 the client may retry (the openai SDK honours ``Retry-After``)."""
    return {"Retry-After": str(RETRY_AFTER_S)}


class DrainMiddleware(ASGIMiddleware):
    """Counts requests in flight for ``drain`` and refuses new ones while it drains."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, drain: Drain) -> None:
        self.drain = drain

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        if self.drain.draining and scope["path"] not in PASS_WHILE_DRAINING:
            await _send_shutting_down(send)
            return
        self.drain.in_flight += 1
        try:
            await next_app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


async def _send_shutting_down(send: Send) -> None:
    error = APIError(
        503,
        "The server is shutting down and accepts no new requests; retry on another replica.",
        code="server_shutting_down",
    )
    body = msgspec.json.encode(error.body())
    headers = {
        "content-type": "application/json",
        "content-length": str(len(body)),
        "connection": "close",  # the client's retry opens a new connection, maybe elsewhere
        **{k.lower(): v for k, v in retry_later_headers().items()},
    }
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
