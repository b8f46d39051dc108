"""The Litestar application: ``create_app(engine)`` wires routes, errors and the engine's lifetime.

1. The lifespan context starts the engines (compiling and warming up, in a worker thread so the
   event loop stays free; one after another) before the first request, and shuts them down after
   the last connection closed.
2. Route handlers receive the app's ``ModelRegistry`` (``api.service.served_models``: one engine, or
   several named models) and the model cards by dependency injection, and run on the engine of
   the model the request names; there is no module-level state, so several apps (e.g. in tests)
   can live in one process.
3. Every error leaves as the OpenAI envelope (``api.protocol.errors``).
4. ``ServerConfig`` (``api.service.settings``) adds the API key guard, CORS, the body size cap, sampling
   defaults and served-model aliases; each app has its own Prometheus registry (``api.service.metrics``).
5. A full engine queue (``EngineOverloadedError``) is a 503 with ``Retry-After``; ``Drain``
   (``api.service.draining``) counts the requests in flight and refuses new ones during a graceful
   shutdown.
6. The operator's MCP servers (``ServerConfig.mcp_servers``) are connected by a lifespan entry
   that runs before the engine's, so a server that cannot start fails the startup at once, and
   are closed after the engine has shut down (``api.mcp.client``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from litestar import Litestar, Request, Response
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig

from jax_llm_runtime.api.mcp.client import McpClients
from jax_llm_runtime.api.protocol.bodies import ErrorResponse, ModelCard
from jax_llm_runtime.api.protocol.errors import APIError, exception_handlers
from jax_llm_runtime.api.responses.store import ResponseStore
from jax_llm_runtime.api.routes import ROUTE_HANDLERS
from jax_llm_runtime.api.routes.service import package_version
from jax_llm_runtime.api.routes.ui import ui_route_handlers
from jax_llm_runtime.api.service.auth import api_key_guard
from jax_llm_runtime.api.service.dependencies import provide_dependencies
from jax_llm_runtime.api.service.draining import Drain, DrainMiddleware, retry_later_headers
from jax_llm_runtime.api.service.metrics import Metrics
from jax_llm_runtime.api.service.request_id import response_hook
from jax_llm_runtime.api.service.served_models import ModelRegistry, ServedModel
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.interface import EngineClient, EngineOverloadedError

logger = logging.getLogger(__name__)

OWNED_BY = "jax-llm-runtime"


def _overloaded(_: Request[Any, Any, Any], exc: EngineOverloadedError) -> Response[ErrorResponse]:
    error = APIError(503, str(exc), code="engine_overloaded")
    return Response(error.body(), status_code=503, headers=retry_later_headers())


def _model_cards(registry: ModelRegistry) -> list[ModelCard]:
    """One /v1/models card per served name."""
    created = int(time.time())
    return [
        ModelCard(
            id=name, created=created, owned_by=OWNED_BY, max_model_len=entry.engine.max_model_len
        )
        for entry in registry.entries
        for name in entry.names
    ]


def _mcp_lifespan(mcp: McpClients) -> Callable[[Litestar], AbstractAsyncContextManager[None]]:
    """The MCP servers are connected before the engines start, and closed after they stop."""

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        await mcp.connect()
        try:
            yield
        finally:
            await mcp.close()

    return lifespan


def _engine_lifespan(
    registry: ModelRegistry, drain: Drain
) -> Callable[[Litestar], AbstractAsyncContextManager[None]]:
    """The engines start one after another (compilation and warmup) and shut down together."""

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        try:
            for entry in registry.entries:
                logger.info("starting engine for %s", entry.name)
                await asyncio.to_thread(entry.engine.start)
                logger.info(
                    "engine ready: %s (max_model_len=%d)", entry.name, entry.engine.max_model_len
                )
            yield
        finally:
            logger.info("shutting down engines: %s", ", ".join(e.name for e in registry.entries))
            await drain.shutdown_engine(registry)

    return lifespan


def create_app(
    models: EngineClient | Sequence[ServedModel],
    *,
    config: ServerConfig | None = None,
    debug: bool = False,
    drain: Drain | None = None,
) -> Litestar:
    """An OpenAI-compatible app serving ``models`` (one engine, or several ``ServedModel``s each
    answering to its engine's ``model_name``); the app owns the engines' start and shutdown.

    ``drain`` is the shutdown state the server's SIGTERM handler drives (a fresh one if None).
    The app's ``ModelRegistry`` is ``app.state.models``.

    Logging is left to the caller (``api.cli.serve`` configures it), so importing or embedding the app
    never reconfigures the process's loggers. Raises ValueError when ``config`` names served
    models whose first (the reported name) is not the engine's ``model_name``, names aliases for
    several models, or when two models answer to one name.
    """
    config = config or ServerConfig()
    served = list(models) if isinstance(models, Sequence) else [ServedModel(models)]
    registry = ModelRegistry(served, config)
    metrics = Metrics([entry.engine for entry in registry.entries])
    drain = drain or Drain()
    mcp = McpClients(config.mcp_servers, config.mcp_timeout_s, config.mcp_max_output_bytes)
    return Litestar(
        route_handlers=[*ROUTE_HANDLERS, *ui_route_handlers(config.ui)],
        lifespan=[_mcp_lifespan(mcp), _engine_lifespan(registry, drain)],
        dependencies=provide_dependencies(
            registry, _model_cards(registry), metrics, mcp, ResponseStore()
        ),
        exception_handlers={**exception_handlers(), EngineOverloadedError: _overloaded},
        middleware=[DrainMiddleware(drain)],
        state=State({"drain": drain, "mcp": mcp, "models": registry}),
        guards=[api_key_guard(config.api_key)] if config.api_key else [],
        before_send=[response_hook(metrics)],
        cors_config=CORSConfig(allow_origins=list(config.allowed_origins))
        if config.allowed_origins
        else None,
        request_max_body_size=config.max_request_body_bytes,
        logging_config=None,
        openapi_config=OpenAPIConfig(
            title="jax-llm-runtime", version=package_version(), path="/schema"
        ),
        debug=debug,
    )
