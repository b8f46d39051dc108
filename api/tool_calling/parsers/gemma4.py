"""Gemma 4: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, arguments in Gemma's notation.

The grammar is in the package docstring. Gemma writes its arguments in JSON's shape with other
tokens: keys bare, strings between ``<|"|>`` quote tokens with nothing escaped inside (the quote
is one special token, so a string can hold any text but that token), numbers, booleans and null
bare, lists and objects nested. The parser writes the JSON itself, a token at a time, so
``arguments`` is ``json.dumps`` of the arguments object (``", "`` and ``": "`` between members,
``ensure_ascii=False``): a string is sent as its text arrives, any other value once it ends.
What was sent is always the start of what the whole call would give.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from jax_llm_runtime.api.tool_calling.parsers.stream import (
    Block,
    Status,
    ToolCallStream,
    ToolParser,
)

QUOTE = '<|"|>'
CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
# The call markers are single special tokens, so they cannot be string text: a string that meets
# one was never closed.
_STRING_ENDS = (QUOTE, CALL_CLOSE, CALL_OPEN)
MAX_NAME_CHARS = 256
_NAME = re.compile(r"[^\s{}()<>\[\]\",:;']{1,256}")  # up to MAX_NAME_CHARS
# A bare key runs to its colon; these characters cannot be in one.
_BARE_KEY = re.compile(r"[^:{}\[\],<>\"\n\r]*")
# A bare value (a number, true, false, null, or a word) runs to the next delimiter.
_BARE_VALUE = re.compile(r"[^\s,{}\[\]<>]*")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# Jinja writes Python's None for a null in the history, so the model may too.
_LITERALS = {
    "true": "true",
    "false": "false",
    "null": "null",
    "True": "true",
    "False": "false",
    "None": "null",
}
_WS = " \t\n\r"


def bare_value_json(raw: str) -> str:
    """The JSON of a value written without quote tokens: a JSON number as written, a literal,
    or else a string of the text (the model left its quotes out)."""
    if _JSON_NUMBER.fullmatch(raw):
        return raw
    literal = _LITERALS.get(raw)
    return literal if literal is not None else json.dumps(raw, ensure_ascii=False)


def _string_json(text: str) -> str:
    """``text`` escaped as the inside of a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _partial_end(text: str, ends: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``ends``."""
    longest = 0
    for end in ends:
        for size in range(min(len(text), len(end) - 1), longest, -1):
            if end.startswith(text[-size:]):
                longest = size
                break
    return longest


def _out_of_text(s: ToolCallStream) -> Status:
    """NEED; at the end of the reply, the markup was cut off: the rest is consumed, FAIL."""
    if not s.final:
        return Status.NEED
    s.pos = len(s.text)
    return Status.FAIL


def _literal(s: ToolCallStream, text: str) -> Status | None:
    """Move past ``text`` at ``pos`` (None), or say why not."""
    found = s.marker_at(text)
    if found is Status.DONE:
        s.pos += len(text)
        return None
    return Status.FAIL if found is Status.FAIL else _out_of_text(s)


class _S(enum.Enum):
    CALL = "call"  # "call:"
    NAME = "name"  # the function's name and "{"
    KEY = "key"  # a key, or the object's end (after "{" or ",")
    QUOTED_KEY = "quoted key"  # a key between quote tokens
    COLON = "colon"
    ELEMENT = "element"  # a list item, or the list's end (after "[" or ",")
    VALUE = "value"
    STRING = "string"  # inside a string
    NEXT = "next"  # after a value: "," or its container's end
    CLOSE = "close"  # after the arguments: "<tool_call|>"


@dataclass
class _Container:
    closer: str  # "}" or "]"
    count: int = 0  # members or items written so far


class _Gemma4Call:
    """After ``<|tool_call>``: one call, its arguments written out as JSON as they are read."""

    def __init__(self) -> None:
        self._stage = _S.CALL
        self._stack: list[_Container] = []
        self._key = ""
        # The readers of the stages that start at the next token, past whitespace.
        self._readers: dict[_S, Callable[[ToolCallStream], Status | None]] = {
            _S.CALL: self._read_call,
            _S.NAME: self._read_name,
            _S.KEY: self._read_key,
            _S.COLON: self._read_colon,
            _S.ELEMENT: self._read_element,
            _S.VALUE: self._read_value,
            _S.NEXT: self._read_next,
        }

    def step(self, s: ToolCallStream) -> Status:
        while True:
            status = self._advance(s)
            if status is Status.FAIL and s.call_open():
                return self._broken(s)
            if status is not None:
                return status

    def _broken(self, s: ToolCallStream) -> Status:
        """The arguments broke at ``pos``: a ``<tool_call|>`` there still closes the call."""
        found = s.marker_at(CALL_CLOSE)
        if found is Status.NEED and not s.final:
            return Status.NEED  # decided once it is known whether the close marker is there
        if found is not Status.FAIL:
            s.pos = min(len(s.text), s.pos + len(CALL_CLOSE))
        return Status.FAIL

    def _advance(self, s: ToolCallStream) -> Status | None:
        """One stage; None to go on reading."""
        stage = self._stage
        if stage is _S.STRING:
            return self._read_string(s)
        if stage is _S.QUOTED_KEY:
            return self._read_quoted_key(s)
        ws = s.skip_ws()
        if stage is _S.CLOSE:
            if ws is Status.FAIL:
                return Status.DONE  # the reply ended after the call
            return ws or self._read_close(s)
        if ws is not None:
            return ws  # at the end of the reply: cut off, with nothing left unread
        return self._readers[stage](s)

    def _read_call(self, s: ToolCallStream) -> Status | None:
        status = _literal(s, "call:")
        if status is None:
            self._stage = _S.NAME
        return status

    def _read_name(self, s: ToolCallStream) -> Status | None:
        found = _NAME.match(s.text, s.pos)
        end = found.end() if found else s.pos
        if end == len(s.text):
            return _out_of_text(s)
        if found is None or s.text[end] != "{":
            return Status.FAIL
        s.pos = end + 1
        s.commit(found.group())
        self._open(s, "}")
        return None

    def _open(self, s: ToolCallStream, closer: str) -> None:
        s.emit_args("{" if closer == "}" else "[")
        self._stack.append(_Container(closer))
        self._stage = _S.KEY if closer == "}" else _S.ELEMENT

    def _close(self, s: ToolCallStream) -> None:
        s.emit_args(self._stack.pop().closer)
        if self._stack:
            self._stage = _S.NEXT
        else:
            s.end_call()
            self._stage = _S.CLOSE

    def _read_key(self, s: ToolCallStream) -> Status | None:
        char = s.text[s.pos]
        if char == "}":  # an empty object, or a comma before its end
            s.pos += 1
            self._close(s)
            return None
        if char == "<":
            status = _literal(s, QUOTE)
            if status is None:
                self._stage = _S.QUOTED_KEY
            return status
        found = _BARE_KEY.match(s.text, s.pos)
        assert found is not None  # the pattern matches the empty string
        end = found.end()
        if end - s.pos > MAX_NAME_CHARS:
            return Status.FAIL
        if end == len(s.text):
            return _out_of_text(s)
        key = found.group().strip()
        if s.text[end] != ":" or not key:
            return Status.FAIL
        s.pos = end
        self._key, self._stage = key, _S.COLON
        return None

    def _read_quoted_key(self, s: ToolCallStream) -> Status | None:
        end = s.text.find(QUOTE, s.pos, s.pos + MAX_NAME_CHARS + len(QUOTE))
        if end < 0:
            if len(s.text) - s.pos > MAX_NAME_CHARS + len(QUOTE):
                return Status.FAIL
            return _out_of_text(s)
        self._key = s.text[s.pos : end]
        s.pos = end + len(QUOTE)
        self._stage = _S.COLON
        return None

    def _read_colon(self, s: ToolCallStream) -> Status | None:
        status = _literal(s, ":")
        if status is not None:
            return status
        container = self._stack[-1]
        separator = ", " if container.count else ""
        container.count += 1
        s.emit_args(separator + json.dumps(self._key, ensure_ascii=False) + ": ")
        self._stage = _S.VALUE
        return None

    def _read_element(self, s: ToolCallStream) -> Status | None:
        if s.text[s.pos] == "]":  # an empty list, or a comma before its end
            s.pos += 1
            self._close(s)
            return None
        container = self._stack[-1]
        if container.count:
            s.emit_args(", ")
        container.count += 1
        self._stage = _S.VALUE
        return None

    def _read_value(self, s: ToolCallStream) -> Status | None:
        char = s.text[s.pos]
        if char == "<":
            status = _literal(s, QUOTE)
            if status is None:
                s.emit_args('"')
                self._stage = _S.STRING
            return status
        if char in "{[":
            s.pos += 1
            self._open(s, "}" if char == "{" else "]")
            return None
        found = _BARE_VALUE.match(s.text, s.pos)
        assert found is not None
        if found.end() == len(s.text):  # it may go on; at the end it is cut off, never sent
            return _out_of_text(s)
        if not found.group():
            return Status.FAIL
        s.pos = found.end()
        s.emit_args(bare_value_json(found.group()))
        self._stage = _S.NEXT
        return None

    def _read_string(self, s: ToolCallStream) -> Status | None:
        text = s.text
        best, which = -1, ""
        for end in _STRING_ENDS:
            index = text.find(end, s.pos)
            if index >= 0 and (best < 0 or index < best):
                best, which = index, end
        if best < 0:  # send what cannot be the start of an end (cut off, it never will be)
            stop = len(text) - _partial_end(text[s.pos :], _STRING_ENDS)
            if stop > s.pos:
                s.emit_args(_string_json(text[s.pos : stop]))
            s.pos = stop
            return _out_of_text(s)
        if best > s.pos:
            s.emit_args(_string_json(text[s.pos : best]))
        s.pos = best
        if which != QUOTE:  # a call marker: the string was never closed
            return Status.FAIL
        s.pos += len(QUOTE)
        s.emit_args('"')
        self._stage = _S.NEXT
        return None

    def _read_next(self, s: ToolCallStream) -> Status | None:
        char = s.text[s.pos]
        container = self._stack[-1]
        if char == ",":
            s.pos += 1
            self._stage = _S.KEY if container.closer == "}" else _S.ELEMENT
            return None
        if char != container.closer:
            return Status.FAIL
        s.pos += 1
        self._close(s)
        return None

    def _read_close(self, s: ToolCallStream) -> Status:
        found = s.marker_at(CALL_CLOSE)
        if found is Status.FAIL:
            return Status.FAIL  # what follows the call is content
        if found is Status.NEED and not s.final:
            return Status.NEED
        s.pos = min(len(s.text), s.pos + len(CALL_CLOSE))  # at the end, a cut-off close counts
        return Status.DONE


class Gemma4Parser(ToolParser):
    """Gemma 4: ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>``."""

    name = "gemma4"
    markers: ClassVar[Mapping[str, Callable[[], Block]]] = {CALL_OPEN: _Gemma4Call}
