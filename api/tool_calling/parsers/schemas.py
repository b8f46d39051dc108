"""Parameter values written as text (XML-style formats) typed by the tools' JSON schemas.

GLM 4.5+, Qwen3-Coder / Qwen3.5 and MiniMax-M2 write each argument as an element whose value is
bare text: ``<arg_value>3</arg_value>`` may be the number 3 or the string "3". The tool's
parameter schema decides: a value is a string unless the schema types the parameter as
something else (number, integer, boolean, null, object or array, alone or among the types of
``type``, ``anyOf`` or ``oneOf``) and the text is valid JSON; text that does not parse stays a
string. A parameter the schema does not know, or a tool without a schema, gets a string.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

_JSON_TYPES = frozenset({"number", "integer", "boolean", "null", "object", "array"})
# Schemas nest anyOf/oneOf/allOf; deeper than this is no schema a model was shown.
_MAX_DEPTH = 8

# function name -> parameter name -> that parameter's JSON schema
ParameterSchemas = Mapping[str, Mapping[str, Any]]


def parameter_schemas(tools: Iterable[Any] | None) -> dict[str, dict[str, Any]]:
    """The parameter schemas of OpenAI-shaped tools (``{"type": "function", "function": {...}}``),
    by function name; malformed entries are skipped (the HTTP layer rejects them first)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        if isinstance(properties, Mapping):
            out[function["name"]] = {k: v for k, v in properties.items() if isinstance(k, str)}
        else:
            out[function["name"]] = {}
    return out


def _types(schema: Any, depth: int = 0) -> set[str]:
    """Every type name a schema allows; an empty set when it names none."""
    if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
        return set()
    kinds = schema.get("type")
    found = {kinds} if isinstance(kinds, str) else {k for k in kinds or () if isinstance(k, str)}
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list):
            for option in options:
                found |= _types(option, depth + 1)
    enum = schema.get("enum")
    if not found and isinstance(enum, list) and enum:
        found = {"string" if isinstance(v, str) else "number" for v in enum}
    return found


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def typed_value(text: str, schema: Any) -> Any:
    """``text`` as the value ``schema`` asks for (see the module docstring)."""
    kinds = _types(schema)
    if "string" in kinds or not kinds & _JSON_TYPES:
        return text
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        pass
    if "boolean" in kinds and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"  # Python's True / False, as models sometimes write
    return text
