"""The request header cap: header blocks past ``MAX_REQUEST_HEADER_BYTES`` are a 431 envelope.

uvicorn refuses a request head it cannot buffer (h11 keeps at most 16 KiB of an incomplete head)
with a plain-text 400 before the app sees it, but a head that arrives whole passes however large
it is. This guard sits below uvicorn's limit, so what reaches the app is capped, and refused in
the OpenAI envelope, whichever way the bytes arrived. The body cap is Litestar's
``request_max_body_size`` (``ServerConfig.max_request_body_bytes``, a 413).
"""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from jax_llm_runtime.api.protocol.errors import APIError

# Names and values of all request headers together (Tomcat's default; nginx allows 8 KiB a line).
MAX_REQUEST_HEADER_BYTES = 8 * 1024


def limit_request_headers(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """A Litestar guard: 431 ``request_headers_too_large`` naming the largest header."""
    headers: list[tuple[bytes, bytes]] = connection.scope["headers"]
    size = sum(len(name) + len(value) for name, value in headers)
    if size <= MAX_REQUEST_HEADER_BYTES:
        return
    name, value = max(headers, key=lambda header: len(header[0]) + len(header[1]))
    raise APIError(
        431,
        f"The request headers hold {size} bytes, above this server's limit of "
        f"{MAX_REQUEST_HEADER_BYTES}; the largest is `{name.decode('latin-1')}` "
        f"({len(name) + len(value)} bytes).",
        code="request_headers_too_large",
    )
