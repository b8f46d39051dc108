"""Every error the server returns is the OpenAI envelope ``{"error": {message, type, param, code}}``.

Litestar picks a handler by the exception's MRO (a status-code key would win over a class key for
``HTTPException``s, so only class keys are used here): ``APIError`` is raised by our own code with
the exact status, param and code; Litestar's ``ValidationException`` and other ``HTTPException``s
(404 unknown route, 405, 413 body too large, ...) keep their status; anything else is a bug and
becomes a logged 500.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.types import ExceptionHandlersMap

from jax_llm_runtime.api.protocol.bodies import ErrorBody, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error for the client: becomes an envelope with this status, message, param and code."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or error_type_for(status_code)

    def body(self) -> ErrorResponse:
        """The envelope, e.g. for an SSE error event."""
        return ErrorResponse(ErrorBody(self.message, self.error_type, self.param, self.code))


def error_type_for(status_code: int) -> str:
    """OpenAI's ``type`` string for a status code."""
    if status_code in _TYPES:
        return _TYPES[status_code]
    return "invalid_request_error" if status_code < 500 else "internal_server_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def not_supported(param: str) -> APIError:
    """A 400 for a field this server accepts only at its default value."""
    return bad_request(
        f"`{param}` is not supported yet by this server; omit it or send its default value.",
        param=param,
        code="unsupported_parameter",
    )


def _envelope(error: APIError, headers: dict[str, str] | None = None) -> Response[ErrorResponse]:
    return Response(content=error.body(), status_code=error.status_code, headers=headers)


def _api_error_handler(_: Request[Any, Any, Any], exc: APIError) -> Response[ErrorResponse]:
    return _envelope(exc)


def _validation_handler(
    _: Request[Any, Any, Any], exc: ValidationException
) -> Response[ErrorResponse]:
    """Litestar's own parameter/body validation (our routes decode bodies themselves)."""
    param: str | None = None
    message = str(exc.detail)
    if isinstance(exc.extra, list) and exc.extra and isinstance(exc.extra[0], dict):
        first = exc.extra[0]
        param = str(first.get("key")) if first.get("key") is not None else None
        message = f"{message}: {first.get('message', '')}".rstrip(": ")
    return _envelope(APIError(exc.status_code, message, param=param))


def _http_exception_handler(
    request: Request[Any, Any, Any], exc: HTTPException
) -> Response[ErrorResponse]:
    message = str(exc.detail)
    if exc.status_code == 404:
        message = f"No route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
    if exc.status_code >= 500:
        logger.error("HTTP %d on %s %s: %s", exc.status_code, request.method, request.url, message)
    return _envelope(APIError(exc.status_code, message), headers=exc.headers)


def _internal_error_handler(
    request: Request[Any, Any, Any], exc: Exception
) -> Response[ErrorResponse]:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _envelope(APIError(500, "The server had an error while processing the request."))


def exception_handlers() -> ExceptionHandlersMap:
    """The handler map for ``Litestar(exception_handlers=...)``."""
    return {
        APIError: _api_error_handler,
        ValidationException: _validation_handler,
        HTTPException: _http_exception_handler,
        Exception: _internal_error_handler,
    }
