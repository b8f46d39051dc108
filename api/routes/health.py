"""GET /health: 200 while the engine loop serves, 503 otherwise (for load balancers)."""

from __future__ import annotations

from litestar import get

from api.dependencies import EngineDep
from api.errors import APIError


@get("/health", sync_to_thread=False)
def health(engine: EngineDep) -> dict[str, str]:
    """``{}``-like ``{"status": "ok"}`` when healthy; raises APIError(503) when not."""
    if not engine.healthy():
        raise APIError(503, "The engine is not running.", code="engine_unhealthy")
    return {"status": "ok"}
