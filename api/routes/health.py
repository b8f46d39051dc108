"""GET /health: 200 while every engine loop serves; 503 when one does not, or when the server
drains for shutdown, so that load balancers stop sending it traffic."""

from __future__ import annotations

from litestar import get
from litestar.datastructures import State

from jax_llm_runtime.api.protocol.errors import APIError
from jax_llm_runtime.api.protocol.openapi import documented
from jax_llm_runtime.api.service.dependencies import ModelsDep


@get("/health", sync_to_thread=False, operation_class=documented())
def health(models: ModelsDep, state: State) -> dict[str, str]:
    """``{"status": "ok"}`` when healthy; raises APIError(503) when not or while draining."""
    if state.drain.draining:
        raise APIError(503, "The server is shutting down.", code="server_shutting_down")
    down = models.unhealthy()
    if down:
        which = "" if len(models.entries) == 1 else f" for {', '.join(down)}"
        raise APIError(503, f"The engine is not running{which}.", code="engine_unhealthy")
    return {"status": "ok"}
