"""GET /v1/models and GET /v1/models/{model}: the one model this server serves."""

from __future__ import annotations

from litestar import get

from api.errors import APIError
from api.protocol import ModelCard, ModelList


@get("/v1/models", sync_to_thread=False)
def list_models(model_card: ModelCard) -> ModelList:
    """The OpenAI model list, holding the served model."""
    return ModelList(data=[model_card])


@get("/v1/models/{model:path}", sync_to_thread=False)
def retrieve_model(model: str, model_card: ModelCard) -> ModelCard:
    """The served model's card; any other name is a 404 ``model_not_found``."""
    name = model.lstrip("/")
    if name != model_card.id:
        raise APIError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )
    return model_card
