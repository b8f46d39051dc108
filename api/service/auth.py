"""``--api-key``: a guard requiring ``Authorization: Bearer <key>`` on the protected routes.

As in vLLM, the OpenAI routes (``/v1/*``) need the key; so do ``/tokenize`` and ``/detokenize``,
which expose the model's tokenizer. ``/health``, ``/version``, ``/metrics`` (scraped by Prometheus,
which usually sends no credentials) and the OpenAPI schema stay open: they reveal no prompts and
cost nothing. The key is compared with ``hmac.compare_digest`` so timing does not leak it.
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard

from jax_llm_runtime.api.protocol.errors import APIError

PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})


def requires_api_key(path: str) -> bool:
    """Whether a request to ``path`` must carry the API key."""
    return path == "/v1" or path.startswith("/v1/") or path in PROTECTED_PATHS


def _bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip()


def api_key_guard(api_key: str) -> Guard:
    """A Litestar guard: 401 ``invalid_api_key`` (OpenAI's envelope) without the right key."""
    expected = api_key.encode()

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        if not requires_api_key(connection.url.path):
            return
        token = _bearer_token(connection.headers.get("authorization"))
        if token is None or not hmac.compare_digest(token.encode(), expected):
            raise APIError(
                401,
                "Incorrect or missing API key: send the header `Authorization: Bearer <key>`.",
                code="invalid_api_key",
            )

    return guard
