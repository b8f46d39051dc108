"""GET /v1/models and GET /v1/models/{model}: the served models, one card per served name."""

from __future__ import annotations

from litestar import get

from jax_llm_runtime.api.protocol.bodies import ModelCard, ModelList
from jax_llm_runtime.api.protocol.errors import APIError
from jax_llm_runtime.api.protocol.openapi import documented


@get("/v1/models", sync_to_thread=False, operation_class=documented())
def list_models(model_cards: list[ModelCard]) -> ModelList:
    """The OpenAI model list: one card per served name, model by model, each model's reported
    name first (the first card is the model of requests that name none)."""
    return ModelList(data=model_cards)


@get("/v1/models/{model:path}", sync_to_thread=False, operation_class=documented())
def retrieve_model(model: str, model_cards: list[ModelCard]) -> ModelCard:
    """The card of a served name; any other name is a 404 ``model_not_found``."""
    name = model.lstrip("/")
    for card in model_cards:
        if card.id == name:
            return card
    raise APIError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )
