"""OpenAI-compatible route handlers, one endpoint family per module.

They sit in one router so that every route is behind the request header cap (``api.limits``).
"""

from litestar import Router

from api.limits import limit_request_headers
from api.routes.chat import create_chat_completion
from api.routes.completions import create_completion
from api.routes.embeddings import create_embeddings
from api.routes.health import health
from api.routes.models import list_models, retrieve_model
from api.routes.responses import create_response
from api.routes.service import get_metrics, get_openapi_json, get_version
from api.routes.tokenize import detokenize, tokenize

_HANDLERS = [create_chat_completion, create_completion, health, list_models, retrieve_model]
_HANDLERS += [tokenize, detokenize, get_version, get_metrics, get_openapi_json]
_HANDLERS += [create_embeddings, create_response]
ROUTE_HANDLERS = [Router(path="/", route_handlers=_HANDLERS, guards=[limit_request_headers])]

__all__ = ["ROUTE_HANDLERS"]
