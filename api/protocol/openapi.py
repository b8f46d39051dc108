"""The OpenAPI document's bodies: request and response schemas from the msgspec structs themselves.

The OpenAI routes read their bodies with ``api.protocol.validation.decode_body`` (so a bad field is our
envelope naming it), which leaves Litestar with no ``data`` parameter to document: the generated
document would show no request body at all. Each route handler therefore names an ``Operation``
class made by ``documented``, which adds

1. the request body, as msgspec's JSON Schema of the struct that decodes it, so the document and
   the validation cannot drift apart (limits declared with ``msgspec.Meta`` appear in both);
2. the 200 body of routes that build their ``Response`` by hand, and for the ones that can stream,
   ``text/event-stream`` events whose ``data`` is a JSON chunk, an error envelope (an error after
   the first byte) or the closing ``[DONE]``;
3. every other status as the OpenAI error envelope (``default``), which is what the error handlers
   in ``api.protocol.errors`` send, in place of Litestar's own validation-error shape.

The schemas are inlined (no ``$ref``): Litestar writes ``components/schemas`` from its own
registry and would drop ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, Operation, RequestBody
from litestar.openapi.spec.base import BaseSchemaObject

from jax_llm_runtime.api.generation.sse import DONE
from jax_llm_runtime.api.protocol.bodies import ErrorResponse

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
_DEFS = "#/$defs/"


@dataclass
class JSONSchema(BaseSchemaObject):
    """A JSON Schema document placed as-is where Litestar expects its ``Schema`` object."""

    document: dict[str, Any]

    def to_schema(self) -> dict[str, Any]:
        return self.document


def json_schema(struct_type: Any) -> dict[str, Any]:
    """msgspec's JSON Schema of ``struct_type`` with every ``$ref`` replaced by its definition.

    Raises ValueError for a recursive type, which cannot be inlined.
    """
    (schema,), definitions = msgspec.json.schema_components([struct_type])
    return _inline(schema, definitions, ())


def _inline(node: Any, definitions: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_inline(item, definitions, seen) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith(_DEFS):
        name = ref[len(_DEFS) :]
        if name in seen:
            raise ValueError(f"{name} is recursive; its schema cannot be inlined")
        return _inline(definitions[name], definitions, (*seen, name))
    return {key: _inline(value, definitions, seen) for key, value in node.items()}


def _media(struct_type: Any) -> OpenAPIMediaType:
    return OpenAPIMediaType(schema=JSONSchema(json_schema(struct_type)))  # type: ignore[arg-type]


def sse_event_schema(chunk_type: Any) -> dict[str, Any]:
    """One server-sent event of a streamed completion (``api.generation.sse``): before Open API 3.2 a
    ``text/event-stream`` schema describes each event, ``{"data": ..., "event": ...}``."""
    payload = {"anyOf": [json_schema(chunk_type), json_schema(ErrorResponse)]}
    data = {
        "anyOf": [
            {"const": DONE},
            {"type": "string", "contentMediaType": JSON, "contentSchema": payload},
        ]
    }
    return {"type": "object", "properties": {"data": data}, "required": ["data"]}


def documented(request: Any = None, response: Any = None, chunk: Any = None) -> type[Operation]:
    """An ``Operation`` class for ``@get``/``@post(operation_class=...)``; see the module docstring.

    ``request``: the struct ``decode_body`` decodes (None: no body). ``response``: the 200 body's
    struct when the handler's annotation does not say it (None keeps Litestar's). ``chunk``: the
    struct each event holds when the 200 may be server-sent events (``"stream": true``).
    """
    request_body = None
    if request is not None:
        request_body = RequestBody(content={JSON: _media(request)}, required=True)
    success = None
    if response is not None:
        content = {JSON: _media(response)}
        if chunk is not None:
            content[EVENT_STREAM] = OpenAPIMediaType(schema=JSONSchema(sse_event_schema(chunk)))  # type: ignore[arg-type]
        success = OpenAPIResponse(description="Request fulfilled", content=content)
    error = OpenAPIResponse(
        description="Any error: the OpenAI envelope, with the field at fault in `param`",
        content={JSON: _media(ErrorResponse)},
    )

    @dataclass
    class DocumentedOperation(Operation):
        def __post_init__(self) -> None:
            if request_body is not None:
                self.request_body = request_body
            responses = {k: v for k, v in (self.responses or {}).items() if k.startswith("2")}
            if success is not None:
                responses["200"] = success
            responses["default"] = error
            self.responses = responses

    return DocumentedOperation
