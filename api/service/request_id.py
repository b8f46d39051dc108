"""``X-Request-Id`` on every response, and the response-status counter.

A ``before_send`` hook sees every response's start message, errors included (even a 404 for an
unknown route), so it is where the header is set and the status code counted. A client's
``X-Request-Id`` is echoed when it is a short printable token; otherwise one is generated.
"""

from __future__ import annotations

import re
import uuid

from litestar.datastructures import MutableScopeHeaders
from litestar.types import BeforeMessageSendHookHandler, Message, Scope

from jax_llm_runtime.api.service.metrics import Metrics

HEADER = "x-request-id"
_ACCEPTED = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


def request_id_of(scope: Scope) -> str:
    """The client's ``X-Request-Id`` when acceptable, else a new one (kept for the request)."""
    state = scope.setdefault("state", {})  # type: ignore[typeddict-item]
    if "request_id" not in state:
        sent = next(
            (
                v.decode("latin-1")
                for k, v in scope.get("headers", ())
                if k.lower() == b"x-request-id"
            ),
            None,
        )
        state["request_id"] = sent if sent and _ACCEPTED.fullmatch(sent) else uuid.uuid4().hex
    return state["request_id"]


def response_hook(metrics: Metrics) -> BeforeMessageSendHookHandler:
    """The app's ``before_send`` hook: set ``X-Request-Id`` and count the status code."""

    def before_send(message: Message, scope: Scope) -> None:
        if message["type"] != "http.response.start":
            return
        headers = MutableScopeHeaders.from_message(message)
        headers[HEADER] = request_id_of(scope)
        metrics.responses.labels(status_code=str(message["status"])).inc()

    return before_send
