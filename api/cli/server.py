"""uvicorn for ``runtime-serve``: announce readiness, drain on SIGTERM.

1. Once the socket listens (the app's lifespan has started the engines), ``Serving <model> on
   http://host:port/v1 (ready in Ns)`` is printed and logged (several models: their names joined
   by commas); scripts and tests wait for it. On a unix socket (``api.cli.unix_socket``) the line
   says ``on unix:///path (ready in Ns)``, and the socket file is removed when the server stops.
2. SIGTERM drains instead of stopping at once (``api.service.draining``): new requests get a 503 and
   ``/health`` turns 503 while the socket stays open, the requests in flight get
   ``shutdown_timeout_s`` to finish and the rest are aborted with an error. Then uvicorn closes
   the socket, the lifespan shuts the engine down, and ``serve`` returns True: exit status 0. A
   second SIGTERM ends the wait early.
3. SIGINT (Ctrl-C) keeps uvicorn's behaviour: up to ``GRACEFUL_SHUTDOWN_S`` for open connections,
   then ``KeyboardInterrupt`` (``runtime-serve`` exits with status 130).
4. Connections are served by uvicorn's h11 protocol with a deadline per request
   (``--request-read-timeout``), a bound on how long a client may leave its response unread
   (``--response-write-timeout``: then its connection is closed and its request aborted) and
   protocol errors in the envelope (``api.cli.http_protocol``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import uvicorn

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.cli.http_protocol import timeout_protocol
from jax_llm_runtime.api.cli.unix_socket import bind_unix_socket
from jax_llm_runtime.api.mcp.client import McpClients
from jax_llm_runtime.api.service.draining import Drain
from jax_llm_runtime.api.service.served_models import ModelRegistry, ServedModel
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.api.ui.port_server import start_ui_port
from jax_llm_runtime.runtime.engine.interface import EngineClient

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5  # uvicorn's wait for open connections once it stops listening


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        models: ModelRegistry,
        drain: Drain,
        shutdown_timeout_s: float,
        started_at: float,
    ) -> None:
        super().__init__(config)
        self._models = models
        self._drain = drain
        self._shutdown_timeout_s = shutdown_timeout_s
        self._started_at = started_at
        self._num_sigterms = 0
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            ready = time.monotonic() - self._started_at
            names = ",".join(entry.name for entry in self._models.entries)
            line = f"Serving {names} on {self._address()} (ready in {ready:.1f}s)"
            logger.info(line)
            print(line, flush=True)

    def _address(self) -> str:
        name = self.servers[0].sockets[0].getsockname()
        if isinstance(name, str):  # a unix socket's path
            return f"unix://{name}"
        host, port = name[:2]
        return f"http://{host}:{port}/v1"

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or not self.started:
            super().handle_exit(sig, frame)
            return
        # Only a flag here (this runs between any two bytecodes); on_tick starts the drain.
        self._num_sigterms += 1
        if self._num_sigterms > 1:
            self._drain.stop_waiting()

    async def on_tick(self, counter: int) -> bool:
        if self._num_sigterms and self._drain_task is None:
            logger.info("SIGTERM: draining before shutdown")
            self._drain_task = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain.run(self._models, self._shutdown_timeout_s)
        finally:
            self.should_exit = True


def uvicorn_config(app: Any, host: str, port: int, server: ServerConfig) -> uvicorn.Config:
    """How ``runtime-serve`` runs ``app`` under uvicorn (tests serve apps the same way)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        log_config=None,  # keep our logging setup (stderr or --log) for uvicorn's loggers too
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=timeout_protocol(server.request_read_timeout_s, server.response_write_timeout_s),
    )


def serve(
    models: EngineClient | Sequence[ServedModel],
    host: str,
    port: int,
    server: ServerConfig,
    shutdown_timeout_s: float,
    started_at: float,
    uds: str | None = None,
) -> bool:
    """Serve ``create_app(models)`` until SIGTERM or SIGINT; False when the app failed to start
    (an engine startup error). ``started_at`` (``time.monotonic()``) is when the process began,
    for the ready line. ``uds``: serve on this unix socket path instead of ``host`` and ``port``.
    Raises ``McpStartupError`` when an MCP server could not be connected, ``UiPortError`` when
    ``--ui-port`` cannot be bound and ``UnixSocketError`` when ``uds`` cannot be."""
    drain = Drain()
    app = create_app(models, config=server, drain=drain)
    config = uvicorn_config(app, host, port, server)
    uvicorn_server = _Server(config, app.state.models, drain, shutdown_timeout_s, started_at)
    mcp: McpClients = app.state.mcp
    start_ui_port(host, server.ui)  # --ui-port: the UI alone on a port of its own
    unix_socket = bind_unix_socket(uds) if uds is not None else None
    try:
        uvicorn_server.run(sockets=None if unix_socket is None else [unix_socket.sock])
    except SystemExit:  # uvicorn's exit status 3 for a failed lifespan startup
        if mcp.startup_error is not None:
            raise mcp.startup_error from None
        raise
    finally:
        if unix_socket is not None:
            unix_socket.sock.close()
            unix_socket.remove()
    return uvicorn_server.started
