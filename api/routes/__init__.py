"""OpenAI-compatible route handlers, one endpoint family per module."""

from api.routes.chat import create_chat_completion
from api.routes.completions import create_completion
from api.routes.health import health
from api.routes.models import list_models, retrieve_model

ROUTE_HANDLERS = [create_chat_completion, create_completion, health, list_models, retrieve_model]

__all__ = ["ROUTE_HANDLERS"]
