"""Dependency injection: what route handlers can ask for, and the providers ``create_app`` installs.

Litestar checks injected values against the parameter's annotation with ``isinstance``, which a
plain ``typing.Protocol`` such as ``EngineClient`` does not support, so handlers annotate the
engine as ``EngineDep`` (validation skipped: the value comes from ``create_app``, not a client).
"""

from __future__ import annotations

from typing import Annotated

from litestar.di import Provide
from litestar.params import Dependency

from api.protocol import ModelCard
from runtime.interface import EngineClient

EngineDep = Annotated[EngineClient, Dependency(skip_validation=True)]


def provide_dependencies(engine: EngineClient, model_card: ModelCard) -> dict[str, Provide]:
    """Providers for ``engine`` (an ``EngineDep``) and ``model_card`` (a ``ModelCard``)."""

    def provide_engine() -> EngineClient:
        return engine

    def provide_model_card() -> ModelCard:
        return model_card

    return {
        "engine": Provide(provide_engine, sync_to_thread=False, use_cache=True),
        "model_card": Provide(provide_model_card, sync_to_thread=False, use_cache=True),
    }
