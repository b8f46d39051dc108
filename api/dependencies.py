"""Dependency injection: what route handlers can ask for, and the providers ``create_app`` installs.

Litestar checks injected values against the parameter's annotation with ``isinstance``, which a
plain ``typing.Protocol`` such as ``EngineClient`` does not support, so handlers annotate the
engine as ``EngineDep`` (validation skipped: the value comes from ``create_app``, not a client).
"""

from __future__ import annotations

from typing import Annotated

from litestar.di import Provide
from litestar.params import Dependency

from api.config import ServerConfig
from api.mcp import McpClients
from api.metrics import Metrics
from api.protocol import ModelCard
from api.responses_store import ResponseStore
from runtime.interface import EngineClient

EngineDep = Annotated[EngineClient, Dependency(skip_validation=True)]


def provide_dependencies(
    engine: EngineClient,
    model_cards: list[ModelCard],
    config: ServerConfig,
    metrics: Metrics,
    mcp: McpClients,
    response_store: ResponseStore,
) -> dict[str, Provide]:
    """Providers for ``engine`` (an ``EngineDep``), ``model_card`` (the reported name's card),
    ``model_cards`` (one per served name), ``config`` (``ServerConfig``), ``metrics``, ``mcp``
    (the MCP servers' tools) and ``response_store`` (recent /v1/responses results)."""

    def constant(value: object) -> Provide:
        return Provide(lambda: value, sync_to_thread=False, use_cache=True)

    return {
        "engine": constant(engine),
        "model_card": constant(model_cards[0]),
        "model_cards": constant(model_cards),
        "config": constant(config),
        "metrics": constant(metrics),
        "mcp": constant(mcp),
        "response_store": constant(response_store),
    }
