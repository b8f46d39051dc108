"""Dependency injection: what route handlers can ask for, and the providers ``create_app`` installs.

Litestar checks injected values against the parameter's annotation with ``isinstance``, which a
plain ``typing.Protocol`` such as ``EngineClient`` does not support, so handlers annotate the
engine as ``EngineDep`` and the registry as ``ModelsDep`` (validation skipped: the values come
from ``create_app``, not a client).

A route that serves a model receives ``models`` (the app's ``ModelRegistry``), decodes its body
and calls ``models.resolve(body.model)``: the entry it gets holds the engine that answers and
the settings its request runs with. Decoding first keeps a malformed body a 400 whatever model
it names; a well-formed one naming no served model is a 404.
"""

from __future__ import annotations

from typing import Annotated

from litestar.di import Provide
from litestar.params import Dependency

from jax_llm_runtime.api.mcp.client import McpClients
from jax_llm_runtime.api.protocol.bodies import ModelCard
from jax_llm_runtime.api.responses.store import ResponseStore
from jax_llm_runtime.api.service.metrics import Metrics
from jax_llm_runtime.api.service.served_models import ModelRegistry
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.interface import EngineClient

EngineDep = Annotated[EngineClient, Dependency(skip_validation=True)]
ModelsDep = Annotated[ModelRegistry, Dependency(skip_validation=True)]


def provide_dependencies(
    models: ModelRegistry,
    model_cards: list[ModelCard],
    metrics: Metrics,
    mcp: McpClients,
    response_store: ResponseStore,
) -> dict[str, Provide]:
    """Providers for ``models`` (a ``ModelsDep``), ``model_cards`` (one per served name of every
    model), ``config`` (the server-wide ``ServerConfig``; a model's own names and sampling
    defaults come with its ``ModelEntry``), ``metrics``, ``mcp`` (the MCP servers' tools) and
    ``response_store`` (recent /v1/responses results)."""

    def constant(value: object) -> Provide:
        return Provide(lambda: value, sync_to_thread=False, use_cache=True)

    config: ServerConfig = models.config
    return {
        "models": constant(models),
        "model_cards": constant(model_cards),
        "config": constant(config),
        "metrics": constant(metrics),
        "mcp": constant(mcp),
        "response_store": constant(response_store),
    }
