"""The Litestar application: ``create_app(engine)`` wires routes, errors and the engine's lifetime.

1. The lifespan context starts the engine (compiling and warming up, in a worker thread so the event
   loop stays free) before the first request, and shuts it down after the last connection closed.
2. Route handlers receive the engine, and the served model's card, by dependency injection; there
   is no module-level state, so several apps (e.g. in tests) can live in one process.
3. Every error leaves as the OpenAI envelope (``api.errors``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar

from api.dependencies import provide_dependencies
from api.errors import exception_handlers
from api.protocol import ModelCard
from api.routes import ROUTE_HANDLERS
from runtime.interface import EngineClient

logger = logging.getLogger(__name__)

OWNED_BY = "jax-llm-runtime"


def create_app(engine: EngineClient, *, debug: bool = False) -> Litestar:
    """An OpenAI-compatible app serving ``engine``; the app owns the engine's start and shutdown.

    Logging is left to the caller (``api.cli`` configures it), so importing or embedding the app
    never reconfigures the process's loggers.
    """
    model_card = ModelCard(
        id=engine.model_name,
        created=int(time.time()),
        owned_by=OWNED_BY,
        max_model_len=engine.max_model_len,
    )

    @asynccontextmanager
    async def engine_lifespan(_: Litestar) -> AsyncIterator[None]:
        logger.info("starting engine for %s", engine.model_name)
        await asyncio.to_thread(engine.start)
        logger.info("engine ready: %s (max_model_len=%d)", engine.model_name, engine.max_model_len)
        try:
            yield
        finally:
            logger.info("shutting down engine")
            await asyncio.to_thread(engine.shutdown)

    return Litestar(
        route_handlers=ROUTE_HANDLERS,
        lifespan=[engine_lifespan],
        dependencies=provide_dependencies(engine, model_card),
        exception_handlers=exception_handlers(),
        logging_config=None,
        openapi_config=None,
        debug=debug,
    )
