"""POST /v1/responses: OpenAI's Responses API (the subset agents use), JSON or SSE.

The request's conversation is the stored one of ``previous_response_id`` (if any) followed by
its ``input`` (``api.responses.items``); ``api.responses.run`` runs it turn by turn, calling the
server's MCP tools in between. Executed MCP calls are ``mcp_call`` output items (what OpenAI's
own MCP tool returns), so agents that run ``function_call`` items themselves leave them alone;
calls of client-defined functions end the response as ``function_call`` items.

Streamed responses are ``event: <type>`` / ``data: <json>`` pairs as OpenAI sends them, with no
``[DONE]``; an error after the first byte is an ``error`` event with the envelope's fields.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.response import ServerSentEventMessage

from jax_llm_runtime.api.generation.sse import ClosingServerSentEvent
from jax_llm_runtime.api.mcp.client import McpClients
from jax_llm_runtime.api.protocol.errors import APIError
from jax_llm_runtime.api.protocol.openapi import documented
from jax_llm_runtime.api.protocol.validation import decode_body
from jax_llm_runtime.api.responses.bodies import (
    ErrorEvent,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
)
from jax_llm_runtime.api.responses.items import chat_tools, input_messages
from jax_llm_runtime.api.responses.run import ResponseRun, RunContext
from jax_llm_runtime.api.responses.store import ResponseStore
from jax_llm_runtime.api.service.dependencies import ModelsDep
from jax_llm_runtime.api.service.disconnect import cancel_on_disconnect, read_body
from jax_llm_runtime.api.service.metrics import Metrics

logger = logging.getLogger(__name__)


def _message(event: ResponseEvent) -> ServerSentEventMessage:
    data = msgspec.json.encode(event).decode()
    return ServerSentEventMessage(data=data, event=type(event).__struct_config__.tag, sep="\n")


async def _stream(run: ResponseRun) -> AsyncGenerator[ServerSentEventMessage, None]:
    events = run.events()
    try:
        async for event in events:
            yield _message(event)
    except APIError as exc:
        yield _message(ErrorEvent(message=exc.message, code=exc.code, param=exc.param))
    except Exception as exc:  # the stream is the only channel left to tell the client
        logger.exception("error while streaming a response", exc_info=exc)
        message = "The server had an error while streaming the response."
        yield _message(ErrorEvent(message=message, code="internal_server_error"))
    finally:
        await events.aclose()


def _previous(store: ResponseStore, response_id: str | None) -> list[Any]:
    if response_id is None:
        return []
    stored = store.get(response_id)
    if stored is None:
        raise APIError(
            400,
            f"Previous response with id '{response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return list(stored.messages)


@post(
    "/v1/responses",
    status_code=200,
    operation_class=documented(ResponsesRequest, ResponseObject, ResponseEvent),
)
async def create_response(
    request: Request[Any, Any, Any],
    models: ModelsDep,
    metrics: Metrics,
    mcp: McpClients,
    response_store: ResponseStore,
) -> Response[Any]:
    """OpenAI responses; see ``ResponsesRequest`` for the accepted fields.

    Errors are OpenAI envelopes: 400 for bad fields (named in ``param``), an unknown
    ``previous_response_id`` (``previous_response_not_found``) and prompts that do not fit the
    context, 404 for another model name, 503 when the engine shuts down mid-request.
    """
    body = decode_body(await read_body(request), ResponsesRequest)
    served = models.resolve(body.model)
    history = _previous(response_store, body.previous_response_id)
    history += input_messages(body, mcp)
    context = RunContext(request, served.engine, served.config, metrics, mcp, response_store)
    run = ResponseRun(context, body, history, chat_tools(body, mcp))
    await run.begin()
    if body.stream:
        stream = _stream(run)

        async def close() -> None:  # also when the client left before the stream began
            await stream.aclose()
            await run.aclose()

        return ClosingServerSentEvent(stream, close=close)
    try:
        return Response(await cancel_on_disconnect(request, run.complete()))
    finally:
        await run.aclose()
