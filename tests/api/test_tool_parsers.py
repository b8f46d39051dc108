"""Tool parsers: recorded-style replies in each format, parsed whole and streamed at random cuts.

Every case is checked three ways: ``parse`` gives the expected content and calls; the stream, cut
at random points (several seeds) and one character at a time, reassembles to exactly what
``parse`` gives (ids aside) with well-shaped OpenAI deltas; and, for well-formed replies, no
piece of markup ever reaches streamed content. Hypothesis then feeds arbitrary marker soup and
generated calls to every parser.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_llm_runtime.api.tool_calling.parsers import (
    PARSERS,
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    StreamEvent,
    ToolCallDelta,
    collect,
    parser_for_template,
)

JSON_FORMATS = ("mistral", "hermes", "llama3_json", "llama3_function", "json")
XML_FORMATS = ("qwen3_coder", "glm45", "minimax_m2")
MARKUP = {
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>", '"parameters"'),
    "llama3_function": ("<function=", "</function>"),
    "json": ('"name"', '"arguments"', '"tool_calls"'),
    "qwen3_coder": ("<tool_call>", "</tool_call>", "<function=", "<parameter=", "</parameter>"),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_value>"),
    "minimax_m2": ("<minimax:tool_call>", "<invoke name=", "<parameter name=", "</invoke>"),
    "gemma4": ("<|tool_call>", "<tool_call|>", "call:", '<|"|>'),
    "openai": (
        "<|start|>",
        "<|channel|>",
        "<|message|>",
        "<|constrain|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
    ),
}
ID_PATTERN = {
    "mistral": re.compile(r"[A-Za-z0-9]{9}"),
    **{name: re.compile(r"call_[A-Za-z0-9]{24}") for name in MARKUP if name != "mistral"},
}
SEEDS = range(6)


def chunks(text: str, seed: int | None) -> list[str]:
    """``text`` cut at random points (seed), or into single characters (None)."""
    if seed is None:
        return list(text)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def check_event_shapes(parser: str, events: list[StreamEvent]) -> None:
    """Content is non-empty; each call opens with id/name/empty arguments, in index order."""
    opened: list[int] = []
    for event in events:
        if isinstance(event, ContentDelta | ReasoningDelta):
            assert event.text
            continue
        wire = event.openai()
        if event.id is not None:
            assert event.index == len(opened), "calls are announced in index order"
            assert ID_PATTERN[parser].fullmatch(event.id), event.id
            assert event.name
            assert wire == {
                "index": event.index,
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            opened.append(event.index)
        else:
            assert event.index in opened and event.arguments
            assert wire == {"index": event.index, "function": {"arguments": event.arguments}}


def stream(parser: str, pieces: list[str], tools: Any = None) -> list[StreamEvent]:
    s = PARSERS[parser](tools).stream()
    events = [event for piece in pieces for event in s.feed(piece)]
    return events + s.finish()


def without_ids(out: ParsedOutput) -> tuple[str | None, list[tuple[str, str]], str | None]:
    return out.content, [(call.name, call.arguments) for call in out.tool_calls], out.reasoning


def assert_stream_agrees(parser: str, text: str, clean: bool, tools: Any = None) -> ParsedOutput:
    """Stream ``text`` at every cut plan; return ``parse(text)`` after checking they agree."""
    parsed = PARSERS[parser](tools).parse(text)
    for call in parsed.tool_calls:
        assert ID_PATTERN[parser].fullmatch(call.id), call.id
    for seed in [*SEEDS, None]:
        events = stream(parser, chunks(text, seed) if text else [], tools)
        check_event_shapes(parser, events)
        assert without_ids(collect(events)) == without_ids(parsed), f"seed {seed}"
        if clean:
            content = "".join(e.text for e in events if not isinstance(e, ToolCallDelta))
            for marker in MARKUP[parser]:
                assert marker not in content, (marker, content)
    return parsed


@dataclass(frozen=True)
class Case:
    parser: str
    id: str
    text: str
    content: str | None
    calls: list[tuple[str, str]]
    clean: bool = True  # well-formed: no markup may reach the content
    reasoning: str | None = None  # harmony's analysis channel
    tools: list[dict[str, Any]] | None = None  # their schemas type XML parameter values


NESTED_ARGS = json.dumps(
    {
        "query": "SELECT '{' || name || '}' FROM t WHERE note = \"a \\\"b\\\" }]\"",
        "options": {"limit": [1, {"x": None}], "dry_run": False, "ratio": -1.5e-3},
    }
)
UNICODE_ARGS = (
    '{"text": "Grüße aus Köln 🌧️ — ça va?", "target": "日本語", "escaped": "\\u00e9\\ud83d\\ude00"}'
)
CODE_ARGS = '{"path": "a.py", "code": "def f():\\n    return {\\"a\\": [1, 2]}\\n"}'

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                    "hourly": {"type": ["boolean", "null"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                    "limit": {"type": "number"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
]

CASES = [
    # Qwen 2.5 / 3 and Hermes: <tool_call> blocks.
    Case(
        "hermes",
        "single",
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": "celsius"}}\n</tool_call>',
        None,
        [("get_current_weather", '{"location": "San Francisco, CA", "unit": "celsius"}')],
    ),
    Case(
        "hermes",
        "parallel after text",
        "I'll check both cities.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>',
        "I'll check both cities.",
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Tokyo"}')],
    ),
    Case(
        "hermes",
        "hermes key order",
        '<tool_call>\n{"arguments": {"symbol": "NVDA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
        None,
        [("get_stock_fundamentals", '{"symbol": "NVDA"}')],
    ),
    Case(
        "hermes",
        "several objects in one block",
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n{"name": "b", "arguments": {"y": [2]}}\n</tool_call>',
        None,
        [("a", '{"x": 1}'), ("b", '{"y": [2]}')],
    ),
    Case(
        "hermes",
        "a list in the block",
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": null}}]</tool_call>',
        None,
        [("a", "{}"), ("b", '{"k": null}')],
    ),
    Case(
        "hermes",
        "nested braces and quotes",
        f'<tool_call>\n{{"name": "run_sql", "arguments": {NESTED_ARGS}}}\n</tool_call>',
        None,
        [("run_sql", NESTED_ARGS)],
    ),
    Case(
        "hermes",
        "unicode",
        f'Übersetze…\n<tool_call>\n{{"name": "translate", "arguments": {UNICODE_ARGS}}}\n</tool_call>',
        "Übersetze…",
        [("translate", UNICODE_ARGS)],
    ),
    Case(
        "hermes",
        "markers inside argument strings",
        '<tool_call>\n{"name": "echo", "arguments": {"text": "</tool_call> and <tool_call> {"}}\n</tool_call>',
        None,
        [("echo", '{"text": "</tool_call> and <tool_call> {"}')],
    ),
    Case(
        "hermes",
        "string arguments",
        '<tool_call>\n{"name": "f", "arguments": " {\\"a\\": 1} "}\n</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),
    Case(
        "hermes",
        "no arguments",
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
        None,
        [("get_time", "{}")],
    ),
    Case(
        "hermes",
        "text after the call",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nCalling it now.',
        "Calling it now.",
        [("f", "{}")],
    ),
    Case(
        "hermes",
        "text around the call",
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone.',
        "Sure.\nDone.",
        [("f", "{}")],
    ),
    Case(
        "hermes",
        "close marker cut off at the end",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_',
        None,
        [("f", '{"a": 1}')],
    ),
    Case("hermes", "plain prose", "The answer is 42.\n", "The answer is 42.\n", []),
    Case(
        "hermes",
        "prose mentioning the marker",
        "Wrap each call in a <tool_call> tag, like <tool_call>this</tool_call>.",
        "Wrap each call in a <tool_call> tag, like <tool_call>this</tool_call>.",
        [],
        clean=False,
    ),
    Case(
        "hermes",
        "prose mention, then a real call",
        'Use <tool_call> tags.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "Use <tool_call> tags.",
        [("f", "{}")],
        clean=False,
    ),
    Case(
        "hermes",
        "malformed JSON",
        'Let me see.\n<tool_call>\n{"name": "get_weather", arguments: {"city": "Paris"}}\n</tool_call>',
        'Let me see.\n<tool_call>\n{"name": "get_weather", arguments: {"city": "Paris"}}\n</tool_call>',
        [],
        clean=False,
    ),
    Case(
        "hermes",
        "single-quoted arguments",
        '<tool_call>\n{"name": "f", "arguments": {\'city\': \'Paris\'}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {\'city\': \'Paris\'}}\n</tool_call>',
        [],
        clean=False,
    ),
    Case(
        "hermes",
        "missing name",
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        [],
        clean=False,
    ),
    Case(
        "hermes",
        "empty name",
        '<tool_call>\n{"name": "  ", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "  ", "arguments": {}}\n</tool_call>',
        [],
        clean=False,
    ),
    Case(
        "hermes",
        "empty block",
        "<tool_call>\n</tool_call>",
        "<tool_call>\n</tool_call>",
        [],
        clean=False,
    ),
    Case(
        "hermes",
        "cut off before the name (max_tokens)",
        '<tool_call>\n{"name": "get_wea',
        '<tool_call>\n{"name": "get_wea',
        [],
        clean=False,
    ),
    Case(
        "hermes",
        "cut off in the arguments (max_tokens)",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        None,
        [("get_weather", '{"city": "Par')],
    ),
    Case(
        "hermes",
        "missing brace before the close marker",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),
    Case(
        "hermes",
        "unbalanced arguments closed by the marker",
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, \n</tool_call>\nok',
        "ok",
        [("f", '{"a": [1,')],
    ),
    Case(
        "hermes",
        "junk after a complete call",
        '<tool_call>\n{"name": "f", "arguments": {}} extra\n</tool_call>',
        "extra\n</tool_call>",
        [("f", "{}")],
        clean=False,
    ),
    # Mistral: [TOOL_CALLS], JSON list (v2-v7 tokenizers) or name[ARGS]{...} (v11+).
    Case(
        "mistral",
        "v3 list",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
        None,
        [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')],
    ),
    Case(
        "mistral",
        "v3 parallel with ids",
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "abcDEF123"}, '
        '{"name": "b", "arguments": {"y": "z"}, "id": "ghiJKL456"}]',
        None,
        [("a", '{"x": 1}'), ("b", '{"y": "z"}')],
    ),
    Case(
        "mistral",
        "v11 single",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
        None,
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    Case(
        "mistral",
        "v11 parallel after text",
        'Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
        "Checking both.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')],
    ),
    Case(
        "mistral",
        "v11 with call id",
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    Case(
        "mistral",
        "v11 nested and code",
        f"[TOOL_CALLS]write_file[ARGS]{CODE_ARGS}[TOOL_CALLS]run_sql[ARGS]{NESTED_ARGS}",
        None,
        [("write_file", CODE_ARGS), ("run_sql", NESTED_ARGS)],
    ),
    Case(
        "mistral",
        "unicode",
        f'[TOOL_CALLS] [{{"name": "translate", "arguments": {UNICODE_ARGS}}}]',
        None,
        [("translate", UNICODE_ARGS)],
    ),
    Case(
        "mistral",
        "v11 cut off in the arguments",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        None,
        [("get_weather", '{"city": "Par')],
    ),
    Case(
        "mistral",
        "v11 broken arguments, next call still read",
        '[TOOL_CALLS]a[ARGS]{"x": [1, 2[TOOL_CALLS]b[ARGS]{}',
        None,
        [("a", '{"x": [1, 2'), ("b", "{}")],
    ),
    Case(
        "mistral",
        "malformed JSON",
        '[TOOL_CALLS] [{"name": "f", "arguments": {\'a\': 1}}]',
        '[TOOL_CALLS] [{"name": "f", "arguments": {\'a\': 1}}]',
        [],
        clean=False,
    ),
    Case(
        "mistral",
        "missing name",
        '[TOOL_CALLS] [{"arguments": {"a": 1}}]',
        '[TOOL_CALLS] [{"arguments": {"a": 1}}]',
        [],
        clean=False,
    ),
    Case(
        "mistral",
        "bad bare name",
        '[TOOL_CALLS]get weather[ARGS]{"a": 1}',
        '[TOOL_CALLS]get weather[ARGS]{"a": 1}',
        [],
        clean=False,
    ),
    Case(
        "mistral",
        "prose mentioning the marker",
        "The [TOOL_CALLS] token starts a call.",
        "The [TOOL_CALLS] token starts a call.",
        [],
        clean=False,
    ),
    Case("mistral", "plain prose", "Bonjour ! [1, 2] {x}", "Bonjour ! [1, 2] {x}", []),
    # Llama 3.x: bare JSON with "parameters", maybe after <|python_tag|>, maybe several.
    Case(
        "llama3_json",
        "single",
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        None,
        [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')],
    ),
    Case(
        "llama3_json",
        "python tag and arguments key",
        '<|python_tag|>{"name": "search", "arguments": {"query": "jax pallas"}}',
        None,
        [("search", '{"query": "jax pallas"}')],
    ),
    Case(
        "llama3_json",
        "parallel with semicolons",
        '\n\n{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": {"z": "}"}}};',
        None,
        [("a", '{"x": 1}'), ("b", '{"y": {"z": "}"}}')],
    ),
    Case(
        "llama3_json",
        "text before the python tag",
        f'Let me look that up.<|python_tag|>{{"name": "run_sql", "parameters": {NESTED_ARGS}}}',
        "Let me look that up.",
        [("run_sql", NESTED_ARGS)],
    ),
    Case(
        "llama3_json",
        "unicode",
        f'{{"type": "function", "name": "translate", "parameters": {UNICODE_ARGS}}}',
        None,
        [("translate", UNICODE_ARGS)],
    ),
    Case(
        "llama3_json",
        "plain answer",
        "The capital of France is Paris.",
        "The capital of France is Paris.",
        [],
    ),
    Case(
        "llama3_json",
        "JSON answer that is no call",
        '{"name": "Alice", "age": 30}',
        '{"name": "Alice", "age": 30}',
        [],
        clean=False,
    ),
    Case(
        "llama3_json",
        "built-in tool syntax",
        '<|python_tag|>brave_search.call(query="weather in Paris")',
        '<|python_tag|>brave_search.call(query="weather in Paris")',
        [],
        clean=False,
    ),
    Case(
        "llama3_json",
        "malformed JSON",
        '{"name": "f" "parameters": {"a": 1}}',
        '{"name": "f" "parameters": {"a": 1}}',
        [],
        clean=False,
    ),
    Case(
        "llama3_json",
        "missing closing brace",
        '{"name": "f", "parameters": {"a": 1}',
        None,
        [("f", '{"a": 1}')],
    ),
    # Llama 3.1's <function=name>{...}</function> and Functionary v3.1.
    Case(
        "llama3_function",
        "single",
        '<function=spotify_trending_songs>{"n": "5"}</function>',
        None,
        [("spotify_trending_songs", '{"n": "5"}')],
    ),
    Case(
        "llama3_function",
        "parallel after text",
        'Two lookups:\n<function=get_weather>{"city": "Paris"}</function>\n<function=get_weather>{"city": "Rome"}</function>',
        "Two lookups:",
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')],
    ),
    Case(
        "llama3_function",
        "close marker inside a string",
        f'<function=echo>{{"text": "</function> {{"}}</function><function=sql>{NESTED_ARGS}</function>',
        None,
        [("echo", '{"text": "</function> {"}'), ("sql", NESTED_ARGS)],
    ),
    Case(
        "llama3_function",
        "unicode, close marker cut off",
        f"<function=translate> {UNICODE_ARGS} </func",
        None,
        [("translate", UNICODE_ARGS)],
    ),
    Case(
        "llama3_function",
        "bad name",
        '<function=get weather>{"a": 1}</function>',
        '<function=get weather>{"a": 1}</function>',
        [],
        clean=False,
    ),
    Case(
        "llama3_function",
        "arguments not JSON",
        "<function=f>city=Paris</function>",
        "<function=f>city=Paris</function>",
        [],
        clean=False,
    ),
    # Generic JSON: the whole reply is the call(s).
    Case(
        "json",
        "single",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    Case(
        "json",
        "list",
        f' [{{"name": "a", "arguments": {{}}}}, {{"name": "run_sql", "arguments": {NESTED_ARGS}}}]\n',
        None,
        [("a", "{}"), ("run_sql", NESTED_ARGS)],
    ),
    Case(
        "json",
        "tool_calls wrapper in OpenAI's shape",
        '{"tool_calls": [{"id": "x", "type": "function", "function": {"name": "translate", '
        '"arguments": "{\\"text\\": \\"Grüße\\"}"}}, {"name": "b", "parameters": {"k": true}}]}',
        None,
        [("translate", '{"text": "Grüße"}'), ("b", '{"k": true}')],
    ),
    Case("json", "JSON answer", '{"answer": 42}', '{"answer": 42}', [], clean=False),
    Case("json", "list answer", "[1, 2, 3]", "[1, 2, 3]", [], clean=False),
    Case("json", "empty list", "[]", "[]", [], clean=False),
    Case("json", "prose", "Just text { here }.", "Just text { here }.", []),
    Case(
        "json",
        "missing name",
        '{"arguments": {"city": "Paris"}}',
        '{"arguments": {"city": "Paris"}}',
        [],
        clean=False,
    ),
    Case(
        "json",
        "invalid but balanced arguments pass through",
        '{"name": "f", "arguments": {"a": }}',
        None,
        [("f", '{"a": }')],
    ),
    # Qwen3-Coder, Qwen3.5, Qwen3-Next: <tool_call><function=NAME><parameter=KEY> elements.
    Case(
        "qwen3_coder",
        "one call after text",
        "I'll check the current weather in Paris for you.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n"
        "</function>\n</tool_call>",
        "I'll check the current weather in Paris for you.",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
        tools=TOOLS,
    ),
    Case(
        "qwen3_coder",
        "several calls with values typed by the schema",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n"
        '<parameter=filters>\n{"site": "jma.go.jp", "lang": ["ja", "en"]}\n</parameter>\n'
        "<parameter=limit>\n5.0\n</parameter>\n</function>\n</tool_call>",
        None,
        [
            ("get_weather", '{"city": "Tokyo", "days": 3, "hourly": true}'),
            (
                "search",
                '{"query": "42", "filters": {"site": "jma.go.jp", "lang": ["ja", "en"]}, "limit": 5.0}',
            ),
        ],
        tools=TOOLS,
    ),
    Case(
        "qwen3_coder",
        "multi-line code keeps its inner newlines",
        "Creating the file now.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/app.py\n"
        "</parameter>\n<parameter=content>\ndef main() -> None:\n    print(\"a < b\", {'k': 1})\n\n"
        "\n</parameter>\n</function>\n</tool_call>",
        "Creating the file now.",
        [
            (
                "write_file",
                '{"path": "src/app.py", "content": "def main() -> None:\\n    print(\\"a < b\\", '
                "{'k': 1})\\n\\n\"}",
            )
        ],
        tools=TOOLS,
    ),
    Case(
        "qwen3_coder",
        "unknown tools, unknown parameters and unparsable numbers stay strings",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
        "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call><tool_call>\n<function=other>\n"
        "<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>",
        None,
        [("get_weather", '{"days": "three", "extra": "7"}'), ("other", '{"n": "7"}')],
        tools=TOOLS,
    ),
    Case(
        "qwen3_coder",
        "closing tags left out",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n"
        "</tool_call>",
        None,
        [("get_weather", '{"city": "Oslo", "days": 2}')],
        tools=TOOLS,
    ),
    Case(
        "qwen3_coder",
        "a function without a <tool_call> around it, and one without parameters",
        "Listing.\n<function=list_files>\n</function>\n<tool_call>\n<function=get_weather>\n"
        "</function>\n</tool_call>",
        "Listing.",
        [("list_files", "{}"), ("get_weather", "{}")],
    ),
    Case(
        "qwen3_coder",
        "cut off inside a value",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fran\n</param",
        "Checking.",
        [("get_weather", '{"city": "San Fran"')],
    ),
    Case(
        "qwen3_coder",
        "an empty block is content",
        "<tool_call>\n</tool_call> and <function=> too",
        "<tool_call>\n</tool_call> and <function=> too",
        [],
        clean=False,
    ),
    Case(
        "qwen3_coder",
        "a bad name is content, a later call still counts",
        "<tool_call>\n<function=get weather{x}>\n</function>\n</tool_call>\nretry:\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get weather{x}>\n</function>\n</tool_call>\nretry:",
        [("get_weather", '{"city": "Rome"}')],
        clean=False,
    ),
    # GLM 4.5 / 4.6 / 4.7: <tool_call>NAME <arg_key>/<arg_value> pairs.
    Case(
        "glm45",
        "one call after text",
        "\nI'll look up the forecast for Beijing.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "</tool_call>",
        "\nI'll look up the forecast for Beijing.",
        [("get_weather", '{"city": "Beijing", "days": 3}')],
        tools=TOOLS,
    ),
    Case(
        "glm45",
        "several calls, GLM 4.7's name without a newline, typed values",
        "<tool_call>search<arg_key>query</arg_key><arg_value>1984</arg_value><arg_key>filters"
        '</arg_key><arg_value>{"year": 1949, "tags": ["novel"]}</arg_value><arg_key>limit</arg_key>'
        "<arg_value>ten</arg_value></tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>London</arg_value>\n<arg_key>hourly</arg_key>\n<arg_value>false</arg_value>\n"
        "</tool_call>",
        None,
        [
            (
                "search",
                '{"query": "1984", "filters": {"year": 1949, "tags": ["novel"]}, "limit": "ten"}',
            ),
            ("get_weather", '{"city": "London", "hourly": false}'),
        ],
        tools=TOOLS,
    ),
    Case(
        "glm45",
        "a call without arguments, markup inside a value",
        "<tool_call>list_files\n</tool_call>\n<tool_call>write_file\n<arg_key>path</arg_key>\n"
        "<arg_value>index.html</arg_value>\n<arg_key>content</arg_key>\n"
        '<arg_value><div class="x">a &amp; b</div>\n</arg_value>\n</tool_call>',
        None,
        [
            ("list_files", "{}"),
            (
                "write_file",
                '{"path": "index.html", "content": "<div class=\\"x\\">a &amp; b</div>"}',
            ),
        ],
        tools=TOOLS,
    ),
    Case(
        "glm45",
        "JSON inside <tool_call> is not this format: content",
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
        [],
        clean=False,
    ),
    Case(
        "glm45",
        "a pair cut off before its value",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
        None,
        [("get_weather", '{"city": "Par"')],
    ),
    # MiniMax-M2: <minimax:tool_call><invoke name=..><parameter name=..>.
    Case(
        "minimax_m2",
        "two calls in one block after text",
        'I\'ll check both cities.\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n<parameter name="days">2</parameter>\n'
        '</invoke>\n<invoke name="get_weather">\n<parameter name="city">Lyon</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        "I'll check both cities.",
        [("get_weather", '{"city": "Paris", "days": 2}'), ("get_weather", '{"city": "Lyon"}')],
        tools=TOOLS,
    ),
    Case(
        "minimax_m2",
        "typed values, a name without quotes",
        '<minimax:tool_call>\n<invoke name=search>\n<parameter name="query">007</parameter>\n'
        '<parameter name="filters">{"genre": "spy"}</parameter>\n</invoke>\n</minimax:tool_call>',
        None,
        [("search", '{"query": "007", "filters": {"genre": "spy"}}')],
        tools=TOOLS,
    ),
    Case(
        "minimax_m2",
        "an empty block is content",
        "<minimax:tool_call>\n</minimax:tool_call>",
        "<minimax:tool_call>\n</minimax:tool_call>",
        [],
        clean=False,
    ),
    # Gemma 4: <|tool_call>call:name{...}<tool_call|>, strings between <|"|> quote tokens.
    Case(
        "gemma4",
        "single",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
        None,
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    Case(
        "gemma4",
        "two calls after text",
        "I'll check both cities.\n"
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_call>call:get_weather{city:<|"|>Tokyo<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>',
        "I'll check both cities.",
        [
            ("get_weather", '{"city": "Paris"}'),
            ("get_weather", '{"city": "Tokyo", "unit": "celsius"}'),
        ],
    ),
    Case(
        "gemma4",
        "nested arguments, JSON's special characters inside strings",
        '<|tool_call>call:search{exact:false,filters:{genre:<|"|>spy<|"|>,'
        'year:{from:1962,to:null}},limit:-1.5e3,query:<|"|>007 "quoted" {x} [y], a: b\\n<|"|>,'
        'tags:[<|"|>a<|"|>,<|"|>b, c<|"|>,[],{}]}<tool_call|>',
        None,
        [
            (
                "search",
                '{"exact": false, "filters": {"genre": "spy", "year": {"from": 1962, "to": null}}, '
                '"limit": -1.5e3, "query": "007 \\"quoted\\" {x} [y], a: b\\\\n", '
                '"tags": ["a", "b, c", [], {}]}',
            )
        ],
    ),
    Case(
        "gemma4",
        "no arguments",
        "<|tool_call>call:list_files{}<tool_call|>",
        None,
        [("list_files", "{}")],
    ),
    Case(
        "gemma4",
        "code with line breaks, quotes and markup in a string",
        '<|tool_call>call:write_file{content:<|"|><div class="x">\n  {{ a < b }}\n</div>\n'
        '<|"|>,path:<|"|>index.html<|"|>}<tool_call|>',
        None,
        [
            (
                "write_file",
                '{"content": "<div class=\\"x\\">\\n  {{ a < b }}\\n</div>\\n", '
                '"path": "index.html"}',
            )
        ],
    ),
    Case(
        "gemma4",
        "bare words and the literals Jinja writes",
        "<|tool_call>call:set_mode{level:None,mode:fast,verbose:True}<tool_call|>",
        None,
        [("set_mode", '{"level": null, "mode": "fast", "verbose": true}')],
    ),
    Case(
        "gemma4",
        "keys between quote tokens",
        '<|tool_call>call:set_headers{headers:{<|"|>Content-Type<|"|>:<|"|>text/html<|"|>}}'
        "<tool_call|>",
        None,
        [("set_headers", '{"headers": {"Content-Type": "text/html"}}')],
    ),
    Case(
        "gemma4",
        "the reply ends after the call, without its close",
        'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}',
        "Checking.",
        [("get_weather", '{"city": "Paris"}')],
    ),
    Case(
        "gemma4",
        "cut off by max_tokens inside a string",
        'Sure.\n<|tool_call>call:write_file{path:<|"|>a.py<|"|>,content:<|"|>def f():\n    ret',
        "Sure.",
        [("write_file", '{"path": "a.py", "content": "def f():\\n    ret')],
    ),
    Case(
        "gemma4",
        "cut off by max_tokens inside a number: it is not sent",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:1',
        None,
        [("get_weather", '{"city": "Paris", "days": ')],
    ),
    Case(
        "gemma4",
        "a string left open ends at the close marker",
        '<|tool_call>call:get_weather{city:<|"|>Paris<tool_call|>Anything else?',
        "Anything else?",
        [("get_weather", '{"city": "Paris')],
    ),
    Case(
        "gemma4",
        "broken after the call was announced: the rest is content",
        "<|tool_call>call:get_weather{days:3 city:Paris}<tool_call|>",
        "city:Paris}<tool_call|>",
        [("get_weather", '{"days": 3')],
        clean=False,
    ),
    Case(
        "gemma4",
        "the marker without a call is content",
        "Gemma writes <|tool_call> before a call.",
        "Gemma writes <|tool_call> before a call.",
        [],
        clean=False,
    ),
    Case(
        "gemma4",
        "JSON arguments are not this format: content",
        '<|tool_call>{"name": "get_weather", "arguments": {}}<tool_call|>',
        '<|tool_call>{"name": "get_weather", "arguments": {}}<tool_call|>',
        [],
        clean=False,
    ),
    # gpt-oss: harmony messages.
    Case(
        "openai",
        "reasoning then a call",
        '<|channel|>analysis<|message|>The user asks: "What is the weather in Tokyo?" We need to '
        "call get_weather with location Tokyo.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"location":"Tokyo","unit":"celsius"}'
        "<|call|>",
        None,
        [("get_weather", '{"location":"Tokyo","unit":"celsius"}')],
        reasoning='The user asks: "What is the weather in Tokyo?" We need to call get_weather with '
        "location Tokyo.",
    ),
    Case(
        "openai",
        "reasoning then the final answer",
        "<|channel|>analysis<|message|>Simple greeting; respond politely.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hello! How can I help you today?<|return|>",
        "Hello! How can I help you today?",
        [],
        reasoning="Simple greeting; respond politely.",
    ),
    Case(
        "openai",
        "final without its end token (a stop token the detokenizer left out)",
        "<|channel|>analysis<|message|>2+2=4.<|end|><|start|>assistant<|channel|>final<|message|>"
        "**4**",
        "**4**",
        [],
        reasoning="2+2=4.",
    ),
    Case(
        "openai",
        "recipient before the channel, json without <|constrain|>",
        "<|channel|>analysis<|message|>Need the file.<|end|><|start|>assistant "
        'to=functions.read_file<|channel|>commentary json<|message|>{"path": "README.md"}<|call|>',
        None,
        [("read_file", '{"path": "README.md"}')],
        reasoning="Need the file.",
    ),
    Case(
        "openai",
        "a preamble, then two calls",
        "<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>I'll check both cities.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>\n{"location": "Paris"}\n<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
        "{}<|call|>",
        "I'll check both cities.",
        [("get_weather", '{"location": "Paris"}'), ("get_time", "{}")],
        reasoning="Two lookups.",
    ),
    Case(
        "openai",
        "a call to a built-in tool is no function call",
        '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>',
        None,
        [],
    ),
    Case(
        "openai",
        "cut off inside the arguments",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location": "Tok',
        None,
        [("get_weather", '{"location": "Tok')],
    ),
    Case(
        "openai",
        "no harmony markup: content",
        "The weather in Tokyo is sunny.",
        "The weather in Tokyo is sunny.",
        [],
    ),
    Case(
        "openai",
        "a broken header is content, the next message still counts",
        "<|channel|>analysis<|end|>oops<|channel|>final<|message|>ok<|return|>",
        "<|channel|>analysis<|end|>oopsok",
        [],
        clean=False,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}: {c.id}" for c in CASES])
def test_recorded_outputs(case: Case) -> None:
    parsed = assert_stream_agrees(case.parser, case.text, case.clean, case.tools)
    assert parsed.content == case.content
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == case.calls
    assert parsed.reasoning == case.reasoning
    for call in parsed.tool_calls:
        assert call.openai() == {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }


def test_every_parser_has_cases() -> None:
    assert {case.parser for case in CASES} == set(PARSERS) == set(MARKUP)


def test_arguments_stream_as_they_are_generated() -> None:
    s = PARSERS["hermes"]().stream()
    assert s.feed("Sure.\n<tool_") == [ContentDelta("Sure.")]
    assert s.feed('call>\n{"name": "get_weather", "argu') == []
    head = s.feed('ments": {"ci')
    assert len(head) == 2 and head[0].openai()["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert head[1] == ToolCallDelta(0, '{"ci')
    assert s.feed('ty": "Paris"') == [ToolCallDelta(0, 'ty": "Paris"')]
    assert s.feed("   ") == []  # whitespace waits for what follows it
    assert s.feed("}}\n</tool_call>") == [ToolCallDelta(0, "   }")]
    assert s.finish() == []


def test_held_text_is_released_when_no_marker_follows() -> None:
    s = PARSERS["mistral"]().stream()
    assert s.feed("See [TOOL") == [ContentDelta("See")]
    assert s.feed("S] and more") == [ContentDelta(" [TOOLS] and more")]
    s = PARSERS["hermes"]().stream()
    assert s.feed("ends with <tool_ca") == [ContentDelta("ends with")]
    assert s.finish() == [ContentDelta(" <tool_ca")]


def test_stream_lifecycle() -> None:
    s = PARSERS["json"]().stream()
    assert s.feed("hi ") == [ContentDelta("hi")]
    assert s.finish() == [ContentDelta(" ")]
    assert s.finish() == []
    with pytest.raises(RuntimeError, match="new stream"):
        s.feed("more")


def test_parsed_call_renders_as_openai_message_item() -> None:
    call = PARSERS["hermes"]().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    item = call.tool_calls[0].openai()
    assert item == {
        "id": call.tool_calls[0].id,
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }


def test_ids_are_fresh() -> None:
    text = "".join(f'[TOOL_CALLS]f[CALL_ID]aaaaaaaaa[ARGS]{{"i": {i}}}' for i in range(50))
    ids = [call.id for call in PARSERS["mistral"]().parse(text).tool_calls]
    assert len(ids) == 50 and len(set(ids)) == 50


# Hypothesis: arbitrary marker soup never raises and streams as it parses.

SOUP = [
    *{marker for markers in MARKUP.values() for marker in markers},
    "<|python_tag|>",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ":",
    ",",
    ";",
    ">",
    " ",
    "\n",
    '"name"',
    '"f"',
    '"arguments"',
    '"parameters"',
    '"function"',
    '"id"',
    "{}",
    "1",
    "true",
    "-2.5e3",
    '"\\u00e9"',
    '"\\ud800"',
    "'",
    "<|channel|>analysis<|message|>",
    "<|channel|>final<|message|>",
    "<|start|>assistant",
    " to=functions.f",
    " to=browser.x",
    "commentary",
    " json",
    "<function=f>",
    "<parameter=a>",
    "</function>",
    "f\n",
    "<arg_key>a</arg_key>",
    "<arg_value>",
    "</arg_value>",
    '<invoke name="f">',
    '<parameter name="a">',
    "</parameter>",
    "</minimax:tool_call>",
    "call:f{",
    "k:",
    "<|tool_call>call:f{a:",
]
soup_text = st.lists(st.one_of(st.sampled_from(SOUP), st.text(max_size=4)), max_size=40).map(
    "".join
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parser=st.sampled_from(sorted(PARSERS)), text=soup_text, data=st.data())
def test_any_text_streams_as_it_parses(parser: str, text: str, data: st.DataObject) -> None:
    parsed = PARSERS[parser]().parse(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    events = stream(parser, pieces)
    check_event_shapes(parser, events)
    assert without_ids(collect(events)) == without_ids(parsed)
    if not parsed.tool_calls and parser != "openai":  # no call: the reply is content, verbatim
        assert parsed.content == (text or None)


# Hypothesis: well-formed calls in each format come back exactly.

names = st.from_regex(r"[a-z_][a-z0-9_]{0,20}", fullmatch=True)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)
prose = st.text(alphabet=st.characters(blacklist_characters="<[{"), max_size=30)


def render(parser: str, before: str, items: list[tuple[str, str]]) -> str:
    """``items`` (name, arguments JSON) written as the model family writes them."""
    if parser == "mistral":
        return before + "".join(f"[TOOL_CALLS]{name}[ARGS]{args}" for name, args in items)
    if parser == "hermes":
        blocks = (
            f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in items
        )
        return before + "\n".join(blocks)
    if parser == "llama3_json":
        objects = (f'{{"name": "{n}", "parameters": {a}}}' for n, a in items)
        return before + "<|python_tag|>" + "; ".join(objects)
    if parser == "llama3_function":
        return before + "".join(f"<function={n}>{a}</function>" for n, a in items)
    return json.dumps([{"name": n, "arguments": json.loads(a)} for n, a in items])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parser=st.sampled_from(JSON_FORMATS),
    before=prose,
    items=calls,
    ascii_only=st.booleans(),
    data=st.data(),
)
def test_generated_calls_round_trip(
    parser: str, before: str, items: list[tuple[str, dict[str, Any]]], ascii_only: bool, data: Any
) -> None:
    written = [(name, json.dumps(args, ensure_ascii=ascii_only)) for name, args in items]
    text = render(parser, "" if parser == "json" else before, written)
    parsed = PARSERS[parser]().parse(text)
    got = [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]
    assert got == [(name, json.loads(args)) for name, args in written]
    if parser != "json":
        assert parsed.content == (before.rstrip() or None)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=15)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert without_ids(collect(stream(parser, pieces))) == without_ids(parsed)


# Hypothesis: calls in the XML formats, their values typed by the schema, come back exactly.

_plain = st.text(alphabet=st.characters(blacklist_characters="<", blacklist_categories=("Cs",)))
_xml_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
)
xml_values = (
    _plain.map(str.strip)
    | _xml_scalars
    | st.recursive(
        _xml_scalars | _plain,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_plain, inner, max_size=3),
        max_leaves=6,
    ).filter(lambda v: isinstance(v, list | dict))
)
xml_calls = st.lists(
    st.tuples(names, st.dictionaries(names, xml_values, max_size=4)),
    min_size=1,
    max_size=3,
    unique_by=lambda item: item[0],  # one schema per function
)
_JSON_TYPE = {bool: "boolean", int: "integer", float: "number", type(None): "null"}


def xml_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render_xml(parser: str, before: str, items: list[tuple[str, dict[str, Any]]]) -> str:
    """``items`` written as the XML formats' templates write them."""
    if parser == "qwen3_coder":
        blocks = (
            f"<tool_call>\n<function={name}>\n"
            + "".join(f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in args.items())
            + "</function>\n</tool_call>"
            for name, args in items
        )
        return before + "\n".join(blocks)
    if parser == "glm45":
        blocks = (
            f"<tool_call>{name}\n"
            + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{xml_value(v)}</arg_value>\n"
                for k, v in args.items()
            )
            + "</tool_call>"
            for name, args in items
        )
        return before + "\n".join(blocks)
    invokes = (
        f'<invoke name="{name}">\n'
        + "".join(f'<parameter name="{k}">{xml_value(v)}</parameter>\n' for k, v in args.items())
        + "</invoke>\n"
        for name, args in items
    )
    return before + "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


def schema_of(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, list | dict):
        return {"type": "array" if isinstance(value, list) else "object"}
    return {"type": _JSON_TYPE[type(value)]}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parser=st.sampled_from(XML_FORMATS), before=prose, items=xml_calls, data=st.data())
def test_xml_calls_round_trip(
    parser: str, before: str, items: list[tuple[str, dict[str, Any]]], data: Any
) -> None:
    tools = []
    for name, args in items:
        properties = {k: schema_of(v) for k, v in args.items()}
        tools.insert(
            0,
            {
                "type": "function",
                "function": {
                    "name": name,
                    "parameters": {"type": "object", "properties": properties},
                },
            },
        )
    text = render_xml(parser, before, items)
    parsed = PARSERS[parser](tools).parse(text)
    assert parsed.content == (before.rstrip() or None)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == items
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=15)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert without_ids(collect(stream(parser, pieces, tools))) == without_ids(parsed)


# Hypothesis: harmony replies of reasoning, preambles and calls come back exactly.

harmony_text = st.text(
    alphabet=st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), min_size=1
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    analysis=harmony_text,
    answer=harmony_text,
    items=calls,
    final=st.booleans(),
    data=st.data(),
)
def test_harmony_round_trip(
    analysis: str, answer: str, items: list[tuple[str, dict[str, Any]]], final: bool, data: Any
) -> None:
    text = f"<|channel|>analysis<|message|>{analysis}<|end|>"
    if final:
        text += f"<|start|>assistant<|channel|>final<|message|>{answer}<|return|>"
    else:
        text += f"<|start|>assistant<|channel|>commentary<|message|>{answer}<|end|>"
        for name, args in items:
            text += (
                f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
                f"<|message|>{json.dumps(args)}<|call|>"
            )
    parsed = PARSERS["openai"]().parse(text)
    assert (parsed.reasoning, parsed.content) == (analysis, answer)
    expected = [] if final else [(name, json.dumps(args)) for name, args in items]
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=15)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert without_ids(collect(stream("openai", pieces))) == without_ids(parsed)


# Template detection.


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ('{%- elif message.tool_calls %}{{- "[TOOL_CALLS][" }}{{- out[:-1] }}', "mistral"),
        ("{{- '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}", "mistral"),
        ('{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}', "hermes"),
        (
            "{{- 'return a json object within <tool_call></tool_call> XML tags' }}"
            "{%- for tool in tools %}{{ tool | tojson }}{% endfor %}",
            "hermes",
        ),
        ('{{- "<|python_tag|>" + tool_call.name + ".call(" }}', "llama3_json"),
        (
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}",
            "llama3_json",
        ),
        ("{{ 'start with <function= and end with </function>' }}{% if tools %}", "llama3_function"),
        (
            "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n<parameter=' }}",
            "qwen3_coder",
        ),
        ("{{ '<tool_call>' + tc.name }}{{ '<arg_key>' ~ k ~ '</arg_key>' }}", "glm45"),
        (
            "{{- '<minimax:tool_call>\\n' }}{{- '<invoke name=\"' + tc.name + '\">' }}"
            "{{- '<parameter name=\"' + k + '\">' }}",
            "minimax_m2",
        ),
        ("{{- '<seed:tool_call>\\n<function=' + name + '>\\n<parameter=' + k + '>' }}", None),
        (
            "{%- for call in message['tool_calls'] -%}"
            "{{- '<|tool_call>call:' + call['function']['name'] + '{' -}}"
            "{{- key }}:{{ value }}{{- '}<tool_call|>' -}}{%- endfor -%}",
            "gemma4",
        ),
        (
            "{%- if tool_call.recipient %}{{- '<|start|>assistant to=' + recipient }}"
            "{{- '<|channel|>commentary json<|message|>' }}{%- endif %}",
            "openai",
        ),
        ("{%- if tools is not none %}{{- tools | tojson }}{%- endif %}", "json"),
        (
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}",
            None,
        ),
        ("{{ 'You have no tools.' }}{% for m in messages %}{{ m.content }}{% endfor %}", None),
        ("", None),
        (None, None),
    ],
)
def test_parser_for_template(template: str | None, expected: str | None) -> None:
    assert parser_for_template(template) == expected
    assert expected is None or expected in PARSERS
