"""OpenAI-compatible route handlers, one endpoint family per module.

They sit in one router so that every route is behind the request header cap (``api.service.limits``).
"""

from litestar import Router

from jax_llm_runtime.api.routes.chat import create_chat_completion
from jax_llm_runtime.api.routes.completions import create_completion
from jax_llm_runtime.api.routes.embeddings import create_embeddings
from jax_llm_runtime.api.routes.health import health
from jax_llm_runtime.api.routes.models import list_models, retrieve_model
from jax_llm_runtime.api.routes.responses import create_response
from jax_llm_runtime.api.routes.service import get_metrics, get_openapi_json, get_version
from jax_llm_runtime.api.routes.tokenize import detokenize, tokenize
from jax_llm_runtime.api.service.limits import limit_request_headers

_HANDLERS = [create_chat_completion, create_completion, health, list_models, retrieve_model]
_HANDLERS += [tokenize, detokenize, get_version, get_metrics, get_openapi_json]
_HANDLERS += [create_embeddings, create_response]
ROUTE_HANDLERS = [Router(path="/", route_handlers=_HANDLERS, guards=[limit_request_headers])]

__all__ = ["ROUTE_HANDLERS"]
