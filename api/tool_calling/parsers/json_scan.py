"""Incremental JSON values inside tool markup: where one ends, read whole or sent as it arrives.

Arguments are never parsed into Python objects: ``_ValueScan`` only finds where a JSON value
ends (strings, escapes and bracket nesting) and stops at a character that cannot occur in JSON
outside a string (the ``<`` of ``</tool_call>``) or where one of the format's markers starts
(the ``[`` of ``[TOOL_CALLS]``), so broken arguments never swallow the markup after them.
"""

from __future__ import annotations

import json
import re

from jax_llm_runtime.api.tool_calling.parsers.stream import JSON_WS, Status, ToolCallStream

# Characters of numbers and of true/false/null: the only bare characters besides punctuation.
_SCALAR = frozenset("0123456789+-.eEtruefalsn")
_STRING_SPECIAL = re.compile(r'["\\]')
# Object arguments must open with a key or close at once; this keeps `{'a': 1}` and `{a: 1}`
# from being announced as calls.
_OBJECT_ARGS = re.compile(r'\{[ \t\n\r]*["}]')
_OBJECT_ARGS_PREFIX = re.compile(r"\{[ \t\n\r]*\Z")


class _ValueScan:
    """Finds the end of one JSON value, resumably, without building it.

    ``stops``: markers that end the value where they start outside a string, even where their
    first character could continue it (the ``[`` of ``[TOOL_CALLS]``).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._stop_starts = frozenset(stop[0] for stop in stops)
        self._kind = ""  # "container", "string" or "scalar" once the first character is seen
        self._closers: list[str] = []
        self._in_string = False
        self._escape = False
        self.solid_end = -1  # just past the last character that is not whitespace between tokens

    def scan(self, text: str, pos: int, final: bool) -> tuple[int, Status]:
        """Read from ``pos``; return where reading stopped and DONE (value ends there), NEED
        (text ran out) or FAIL (the character there cannot continue the value)."""
        if not self._kind:
            if pos >= len(text):
                return pos, Status.NEED
            first = text[pos]
            stop = self._stop_at(text, pos) if first in self._stop_starts else None
            if stop is not None:
                return pos, stop
            if first in "{[":
                self._kind = "container"
            elif first == '"':
                self._kind = "string"
            elif first in _SCALAR:
                self._kind = "scalar"
            else:
                return pos, Status.FAIL
        if self._kind == "scalar":
            end = pos
            while end < len(text) and text[end] in _SCALAR:
                end += 1
            self.solid_end = end
            return end, Status.DONE if end < len(text) or final else Status.NEED
        return self._scan_structured(text, pos)

    def _scan_structured(self, text: str, i: int) -> tuple[int, Status]:
        while i < len(text):
            if self._in_string:
                i = self._scan_string(text, i)
                if not self._in_string and not self._closers:
                    return i, Status.DONE  # a top-level string closed
                continue
            if text[i] in JSON_WS:
                i += 1
                continue
            problem = self._take(text, i)
            if problem is not None:
                return i, problem
            i += 1
            self.solid_end = i
            if not self._closers and not self._in_string:
                return i, Status.DONE
        return i, Status.NEED

    def _take(self, text: str, i: int) -> Status | None:
        """Take the character at ``i``, outside strings: FAIL if it cannot continue the value,
        NEED if a stop marker may start there, else None."""
        char = text[i]
        if char in self._stop_starts:
            stop = self._stop_at(text, i)
            if stop is not None:
                return stop
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._closers.append("}" if char == "{" else "]")
        elif char in "}]":
            if not self._closers or self._closers.pop() != char:
                return Status.FAIL
        elif char not in ",:" and char not in _SCALAR:
            return Status.FAIL
        return None

    def _stop_at(self, text: str, i: int) -> Status | None:
        """FAIL if a stop marker starts at ``i``, NEED if the text ends in a prefix of one."""
        for stop in self._stops:
            if text.startswith(stop, i):
                return Status.FAIL
            rest = text[i : i + len(stop)]
            if len(rest) < len(stop) and stop.startswith(rest):
                return Status.NEED
        return None

    def _scan_string(self, text: str, i: int) -> int:
        """Move through string contents; stop just past the closing quote or at the end."""
        while i < len(text):
            if self._escape:
                self._escape = False
                i += 1
                continue
            found = _STRING_SPECIAL.search(text, i)
            if found is None:
                i = len(text)
                break
            i = found.start() + 1
            if found.group() == "\\":
                self._escape = True
            else:
                self._in_string = False
                break
        self.solid_end = i
        return i


class Capture:
    """Reads one JSON value whole; ``raw`` is its text once the step is DONE."""

    def __init__(self, s: ToolCallStream) -> None:
        self._start = s.pos
        self._scan = _ValueScan(s.stops)
        self.raw = ""

    def step(self, s: ToolCallStream) -> Status:
        s.pos, status = self._scan.scan(s.text, s.pos, s.final)
        if status is Status.DONE:
            self.raw = s.text[self._start : s.pos]
        if status is Status.NEED and s.final:
            return Status.FAIL
        return status


class Arguments:
    """Reads an arguments object, sending it as it arrives (``send``) or keeping it in ``text``.

    Whitespace between tokens is held until something follows it, so what was sent never ends
    in whitespace, even when the value is cut off.
    """

    def __init__(self, s: ToolCallStream, send: bool) -> None:
        self._scan = _ValueScan(s.stops)
        self._sent = s.pos
        self._send = send
        self.text = ""

    def step(self, s: ToolCallStream) -> Status:
        s.pos, status = self._scan.scan(s.text, s.pos, s.final)
        if self._scan.solid_end > self._sent:
            piece = s.text[self._sent : self._scan.solid_end]
            self._sent = self._scan.solid_end
            if self._send:
                s.emit_args(piece)
            else:
                self.text += piece
        if status is Status.NEED and s.final:
            return Status.FAIL
        return status


def object_args_start(s: ToolCallStream) -> Status:
    """At a ``{``: DONE if it opens arguments we accept, NEED if undecided, else FAIL."""
    if _OBJECT_ARGS.match(s.text, s.pos):
        return Status.DONE
    if not s.final and _OBJECT_ARGS_PREFIX.match(s.text, s.pos):
        return Status.NEED
    return Status.FAIL


def decode_string(raw: str) -> str | None:
    """A JSON string token's value; None if it is not a valid one or cannot be sent as UTF-8."""
    try:
        value = json.loads(raw, strict=False)
        if isinstance(value, str):
            value.encode("utf-8")  # lone surrogates from "\ud800" escapes cannot be sent
            return value
    except (ValueError, UnicodeEncodeError):
        pass
    return None
