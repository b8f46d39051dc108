"""Call objects and lists of them, read key by key from the stream.

A call object is read key by key so that a call can be announced as soon as its name is known
and its arguments begin; from then on its arguments are sent as they arrive (``Arguments``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from jax_llm_runtime.api.tool_calling.parsers.json_scan import (
    Arguments,
    Capture,
    decode_string,
    object_args_start,
)
from jax_llm_runtime.api.tool_calling.parsers.stream import Status, ToolCallStream

ARGUMENT_KEYS = ("arguments", "parameters")


def _decode_name(raw: str) -> str | None:
    value = decode_string(raw)
    if value is None:
        return None
    name = value.strip()
    return name if name and name.isprintable() else None


def _valid_scalar(raw: str) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


@dataclass
class _Draft:
    """A call being read: its name and arguments may come in either order."""

    name: str | None = None
    has_args: bool = False
    early_args: str | None = None  # arguments read before the name, sent once it is known


class _E(enum.Enum):
    OPEN = "open"
    FIRST_KEY = "first key"
    KEY = "key"
    COLON = "colon"
    VALUE = "value"
    AFTER_VALUE = "after value"


class Envelope:
    """One call object ``{"name": ..., "arguments": ...}``; grammar in the package docstring.

    ``require_args``: a call without arguments is malformed (else its arguments are ``{}``).
    ``wrapper_ok``: the object may instead be ``{"tool_calls": [call, ...]}``.
    ``draft``: given for an object under a ``"function"`` key, which fills its parent's call.
    """

    def __init__(
        self,
        require_args: bool,
        wrapper_ok: bool = False,
        draft: _Draft | None = None,
    ) -> None:
        self._require_args = require_args
        self._wrapper_ok = wrapper_ok
        self._nested = draft is not None
        self._draft = draft if draft is not None else _Draft()
        self._wrapper = False
        self._keys = 0
        self._state = _E.OPEN
        self._key = ""
        self._sub: Capture | Arguments | Envelope | EnvelopeList | None = None
        self._sub_kind = ""

    def step(self, s: ToolCallStream) -> Status:
        while True:
            if self._sub is not None:
                status = self._sub.step(s)
                if status is not Status.DONE:
                    return status
                if not self._sub_done(s):
                    return Status.FAIL
                continue
            status = s.skip_ws()
            if status is None:
                status = self._on_char(s, s.text[s.pos])
            if status is not None:
                return status

    def _on_char(self, s: ToolCallStream, char: str) -> Status | None:
        """Act on the next non-whitespace character; None to go on reading."""
        state = self._state
        if state is _E.VALUE:
            return self._start_value(s, char)
        if state is _E.OPEN:
            return self._expect(s, char, "{", _E.FIRST_KEY)
        if state is _E.COLON:
            return self._expect(s, char, ":", _E.VALUE)
        if state is _E.AFTER_VALUE and char == ",":
            return self._expect(s, char, ",", _E.KEY)
        if char == "}" and state in (_E.FIRST_KEY, _E.AFTER_VALUE):
            s.pos += 1
            return self._close(s)
        if char == '"' and state in (_E.FIRST_KEY, _E.KEY):
            self._sub, self._sub_kind = Capture(s), "key"
            return None
        return Status.FAIL

    def _expect(self, s: ToolCallStream, char: str, wanted: str, then: _E) -> Status | None:
        if char != wanted:
            return Status.FAIL
        s.pos += 1
        self._state = then
        return None

    def _start_value(self, s: ToolCallStream, char: str) -> Status | None:
        """Choose how to read the value of ``self._key``, which starts with ``char``."""
        draft, key = self._draft, self._key
        if key == "tool_calls" and self._wrapper_ok and self._keys == 1 and char == "[":
            self._wrapper = True
            self._sub, self._sub_kind = EnvelopeList(self._require_args), "list"
        elif self._wrapper:
            self._sub, self._sub_kind = Capture(s), "skip"
        elif key == "name" and draft.name is None:
            if char != '"':
                return Status.FAIL
            self._sub, self._sub_kind = Capture(s), "name"
        elif key in ARGUMENT_KEYS and not draft.has_args:
            return self._start_args(s, char)
        elif key == "function" and char == "{" and not self._nested and draft.name is None:
            self._sub, self._sub_kind = Envelope(self._require_args, draft=draft), "nested"
        else:
            self._sub, self._sub_kind = Capture(s), "skip"
        return None

    def _start_args(self, s: ToolCallStream, char: str) -> Status | None:
        draft = self._draft
        if char == '"':
            self._sub, self._sub_kind = Capture(s), "string args"
        elif char == "{":
            status = object_args_start(s)
            if status is not Status.DONE:
                return status
            if draft.name is not None:
                s.commit(draft.name)
            self._sub, self._sub_kind = Arguments(s, send=draft.name is not None), "args"
        else:
            return Status.FAIL
        draft.has_args = True
        return None

    def _sub_done(self, s: ToolCallStream) -> bool:
        """Take in the value just read; False when it makes the call malformed."""
        sub, kind, draft = self._sub, self._sub_kind, self._draft
        self._sub, self._state = None, _E.AFTER_VALUE
        if isinstance(sub, Capture) and kind in ("key", "name", "string args", "skip"):
            raw = sub.raw
            if kind == "key":
                key = decode_string(raw)
                self._key, self._state = key or "", _E.COLON
                self._keys += 1
                return key is not None
            if kind == "name":
                draft.name = _decode_name(raw)
                if draft.name is not None and draft.early_args is not None:
                    self._take_args(s, draft.early_args)
                return draft.name is not None
            if kind == "string args":
                value = decode_string(raw)
                if value is not None:
                    self._take_args(s, value.strip())
                return value is not None
            return raw[0] in '{["' or _valid_scalar(raw)
        if isinstance(sub, Arguments) and draft.name is None:
            draft.early_args = sub.text
        return True

    def _take_args(self, s: ToolCallStream, arguments: str) -> None:
        """Arguments read whole: sent with the announcement if the name is known, else kept."""
        if self._draft.name is None:
            self._draft.early_args = arguments
        else:
            s.commit(self._draft.name)
            s.emit_args(arguments)
            self._draft.early_args = None

    def _close(self, s: ToolCallStream) -> Status:
        if self._wrapper or self._nested:
            return Status.DONE
        draft = self._draft
        if draft.name is None:
            return Status.FAIL
        if not draft.has_args:
            if self._require_args:
                return Status.FAIL
            s.commit(draft.name)
            s.emit_args("{}")
        s.end_call()
        return Status.DONE


class _L(enum.Enum):
    OPEN = "open"
    FIRST = "first"
    ITEM = "item"
    AFTER = "after"


class EnvelopeList:
    """A JSON list of call objects: ``[call, call, ...]``."""

    def __init__(self, require_args: bool) -> None:
        self._require_args = require_args
        self._state = _L.OPEN
        self._item: Envelope | None = None

    def step(self, s: ToolCallStream) -> Status:
        while True:
            if self._item is not None:
                status = self._item.step(s)
                if status is not Status.DONE:
                    return status
                self._item, self._state = None, _L.AFTER
            status = s.skip_ws()
            if status is not None:
                return status
            char = s.text[s.pos]
            if self._state is _L.OPEN and char == "[":
                self._state = _L.FIRST
            elif char == "]" and self._state in (_L.FIRST, _L.AFTER):
                s.pos += 1
                return Status.DONE
            elif char == "{" and self._state in (_L.FIRST, _L.ITEM):
                self._item = Envelope(self._require_args)
                continue
            elif char == "," and self._state is _L.AFTER:
                self._state = _L.ITEM
            else:
                return Status.FAIL
            s.pos += 1
