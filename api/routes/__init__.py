"""OpenAI-compatible route handlers, one endpoint family per module."""

from api.routes.chat import create_chat_completion
from api.routes.completions import create_completion
from api.routes.embeddings import create_embeddings
from api.routes.health import health
from api.routes.models import list_models, retrieve_model
from api.routes.service import get_metrics, get_openapi_json, get_version
from api.routes.tokenize import detokenize, tokenize

ROUTE_HANDLERS = [create_chat_completion, create_completion, health, list_models, retrieve_model]
ROUTE_HANDLERS += [tokenize, detokenize, get_version, get_metrics, get_openapi_json]
ROUTE_HANDLERS += [create_embeddings]

__all__ = ["ROUTE_HANDLERS"]
