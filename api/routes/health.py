"""GET /health: 200 while the engine loop serves; 503 when it does not, or when the server drains
for shutdown, so that load balancers stop sending it traffic."""

from __future__ import annotations

from litestar import get
from litestar.datastructures import State

from api.dependencies import EngineDep
from api.errors import APIError
from api.openapi import documented


@get("/health", sync_to_thread=False, operation_class=documented())
def health(engine: EngineDep, state: State) -> dict[str, str]:
    """``{"status": "ok"}`` when healthy; raises APIError(503) when not or while draining."""
    if state.drain.draining:
        raise APIError(503, "The server is shutting down.", code="server_shutting_down")
    if not engine.healthy():
        raise APIError(503, "The engine is not running.", code="engine_unhealthy")
    return {"status": "ok"}
