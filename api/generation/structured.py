"""``response_format`` to a grammar the engine enforces (``runtime.engine.grammar``).

- ``{"type": "text"}`` (or none): free text;
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON
  matching the schema (OpenAI's shape; ``strict`` is accepted either way, the schema is always
  enforced). A schema that does not compile is a 400 naming ``response_format`` before the request
  reaches the engine.
"""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.api.protocol.errors import bad_request
from jax_llm_runtime.runtime.engine.grammar import GrammarError, json_schema_grammar

TYPES = ("text", "json_object", "json_schema")


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar of a request's ``response_format``; None for free text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in TYPES:
        raise bad_request(
            f"response_format.type must be one of {', '.join(TYPES)}, got {kind!r}",
            param="response_format",
        )
    if kind == "text":
        return None
    schema = None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format.json_schema must be an object with the schema under 'schema'",
                param="response_format",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
    try:
        return json_schema_grammar(schema)
    except GrammarError as exc:
        raise bad_request(f"response_format: {exc}", param="response_format") from None
