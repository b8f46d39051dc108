"""Gemma 4's calls: how their arguments stream as JSON, and generated calls written as Gemma's
chat template writes them coming back exactly. The recorded-style replies are among the cases
of ``test_tool_parsers.py``, checked there with every other format."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_llm_runtime.api.tool_calling.parsers import PARSERS, ContentDelta, ToolCallDelta, collect
from tests.api.test_tool_parsers import assert_stream_agrees, without_ids

QUOTE = '<|"|>'


def test_arguments_stream_as_they_are_read() -> None:
    s = PARSERS["gemma4"]().stream()
    assert s.feed("Checking the forecast.\n<|tool_") == [ContentDelta("Checking the forecast.")]
    assert s.feed("call>call:get_weath") == []
    head = s.feed("er{ci")
    assert len(head) == 2 and head[0].openai()["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert head[1] == ToolCallDelta(0, "{")
    assert s.feed('ty:<|"|>San Fr') == [ToolCallDelta(0, '"city": "San Fr')]
    assert s.feed("ancisco, CA<|") == [ToolCallDelta(0, "ancisco, CA")]  # "<|" may be a quote
    assert s.feed('"|>,days:1') == [ToolCallDelta(0, '", "days": ')]  # the number may go on
    assert s.feed("4,hourly:tr") == [ToolCallDelta(0, '14, "hourly": ')]
    assert s.feed("ue}") == [ToolCallDelta(0, "true}")]
    assert s.feed("<tool_call|>") == []
    assert s.finish() == []


def test_a_string_sends_quotes_and_escapes_as_json() -> None:
    s = PARSERS["gemma4"]().stream()
    events = s.feed('<|tool_call>call:run{cmd:<|"|>echo "hi"\t\\ \n') + s.finish()
    assert collect(events).tool_calls[0].arguments == '{"cmd": "echo \\"hi\\"\\t\\\\ \\n'


def test_forms_the_template_never_writes_are_still_read() -> None:
    # Whitespace between tokens, a comma before a closing bracket, Python's literals.
    text = "<|tool_call>call:f{ a : 1 , b:[ None ,False, ] , }<tool_call|>"
    parsed = assert_stream_agrees("gemma4", text, clean=True)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("f", '{"a": 1, "b": [null, false]}')
    ]


def test_a_reply_after_its_calls_is_content() -> None:
    text = '<|tool_call>call:f{x:<|"|>1<|"|>}<tool_call|>\n\nDone: it is sunny.'
    parsed = assert_stream_agrees("gemma4", text, clean=True)
    assert parsed.content == "Done: it is sunny."
    assert [c.arguments for c in parsed.tool_calls] == ['{"x": "1"}']


# Hypothesis: calls written as Gemma 4's chat template writes them come back as their JSON.

keys = st.from_regex(r"[A-Za-z_]([A-Za-z0-9_ .\-]{0,12}[A-Za-z0-9_])?", fullmatch=True)
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",))).filter(
    lambda t: not any(m in t for m in (QUOTE, "<|tool_call>", "<tool_call|>"))
)
scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
)
values = st.recursive(
    scalars | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)
names = st.from_regex(r"[a-z_][a-z0-9_.\-]{0,20}", fullmatch=True)
calls = st.lists(
    st.tuples(names, st.dictionaries(keys, values, max_size=4)), min_size=1, max_size=3
)
prose = st.text(alphabet=st.characters(blacklist_characters="<", blacklist_categories=("Cs",)))


def gemma(value: Any, none: str) -> str:
    """``value`` in Gemma's notation, keys bare (the template's ``format_argument``)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return none
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma(v, none)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma(v, none) for v in value) + "]"
    return repr(value)  # Python's repr of a finite float is a JSON number


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=prose, items=calls, none=st.sampled_from(["null", "None"]), data=st.data())
def test_generated_calls_round_trip(
    before: str, items: list[tuple[str, dict[str, Any]]], none: str, data: Any
) -> None:
    text = before + "".join(
        f"<|tool_call>call:{name}{gemma(args, none)}<tool_call|>" for name, args in items
    )
    parsed = PARSERS["gemma4"]().parse(text)
    assert parsed.content == (before.rstrip() or None)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        (name, json.dumps(args, ensure_ascii=False)) for name, args in items
    ]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=15)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    s = PARSERS["gemma4"]().stream()
    events = [event for piece in pieces for event in s.feed(piece)] + s.finish()
    assert without_ids(collect(events)) == without_ids(parsed)
