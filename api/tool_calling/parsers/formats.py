"""The formats: one ``Block`` reading each kind of markup, one ``ToolParser`` per model family.

The grammars are in the package docstring; this file follows them.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from typing import ClassVar

from jax_llm_runtime.api.tool_calling.parsers.call_objects import Envelope, EnvelopeList
from jax_llm_runtime.api.tool_calling.parsers.events import mistral_call_id
from jax_llm_runtime.api.tool_calling.parsers.json_scan import Arguments, object_args_start
from jax_llm_runtime.api.tool_calling.parsers.stream import (
    Block,
    Status,
    ToolCallStream,
    ToolParser,
)

MAX_NAME_CHARS = 256
# Function names written as bare text (Mistral's `name[ARGS]`, Llama's `<function=name>`).
_BARE_NAME = re.compile(r"[A-Za-z0-9_.:\-]*")
_CALL_ID = re.compile(r"[A-Za-z0-9]*")


def _close_marker(s: ToolCallStream, close: str) -> Status:
    """``close`` at ``pos`` ends the block, and with it a call whose arguments broke off there;
    so does the end of the text, or a prefix of ``close`` cut off by it."""
    found = s.marker_at(close)
    if found is Status.NEED and not s.final:
        return Status.NEED
    if found is Status.FAIL:
        return Status.FAIL
    if s.call_open():
        s.end_call()
    s.pos = min(len(s.text), s.pos + len(close))
    return Status.DONE


def _bare_name(s: ToolCallStream, ends: tuple[str, ...]) -> tuple[str, str] | Status:
    """A bare function name at ``pos`` and which of ``ends`` follows it (``pos`` moves past both);
    NEED while undecided, FAIL if the name is empty, too long or followed by anything else."""
    found = _BARE_NAME.match(s.text, s.pos)
    assert found is not None  # the pattern matches the empty string
    name, end = found.group(), found.end()
    if len(name) > MAX_NAME_CHARS:
        return Status.FAIL
    for marker in ends:
        if s.text.startswith(marker, end):
            if not name:
                return Status.FAIL
            s.pos = end + len(marker)
            return name, marker
    rest = s.text[end : end + max(map(len, ends))]
    if not s.final and any(len(rest) < len(m) and m.startswith(rest) for m in ends):
        return Status.NEED
    return Status.FAIL


class _Stage(enum.Enum):
    CALL = "call"  # a whole bare call: name, then arguments
    NAME = "name"
    CALL_ID = "call id"
    ARGS = "args"
    IN_ARGS = "in args"
    CLOSE = "close"
    BROKEN = "broken"


class _BareCall:
    """A bare name ended by one of ``ends`` (Mistral's ``[ARGS]`` or ``[CALL_ID]id[ARGS]``,
    Llama's ``>``), then an arguments object."""

    def __init__(self, ends: tuple[str, ...]) -> None:
        self._ends = ends
        self._stage = _Stage.NAME
        self._name = ""
        self._args: Arguments | None = None

    def step(self, s: ToolCallStream) -> Status:
        while True:
            if self._stage is _Stage.NAME:
                found = _bare_name(s, self._ends)
                if isinstance(found, Status):
                    return found
                self._name, after = found
                self._stage = _Stage.CALL_ID if after == "[CALL_ID]" else _Stage.ARGS
            elif self._stage is _Stage.CALL_ID:
                # Mistral's own call id is not used: ids must be unique in a reply, and fresh
                # ones are (see ``mistral_call_id``).
                found = _CALL_ID.match(s.text, s.pos)
                assert found is not None
                s.pos = found.end()
                status = s.marker_at("[ARGS]")
                if status is not Status.DONE:
                    return Status.FAIL if s.final else status
                s.pos += len("[ARGS]")
                self._stage = _Stage.ARGS
            elif self._stage is _Stage.ARGS:
                status = s.skip_ws() or object_args_start(s)
                if status is not Status.DONE:
                    return status
                s.commit(self._name)
                self._args, self._stage = Arguments(s, send=True), _Stage.IN_ARGS
            else:
                assert self._args is not None
                status = self._args.step(s)
                if status is Status.DONE:
                    s.end_call()
                return status


class _MistralBlock:
    """After ``[TOOL_CALLS]``: a list of call objects, one call object, or ``name[ARGS]{...}``."""

    def __init__(self) -> None:
        self._sub: Block | None = None

    def step(self, s: ToolCallStream) -> Status:
        if self._sub is None:
            status = s.skip_ws()
            if status is not None:
                return status
            char = s.text[s.pos]
            if char == "[":
                self._sub = EnvelopeList(require_args=False)
            elif char == "{":
                self._sub = Envelope(require_args=False)
            else:
                self._sub = _BareCall(("[ARGS]", "[CALL_ID]"))
        return self._sub.step(s)


class _HermesBlock:
    """After ``<tool_call>``: one or more call objects or lists of them, then ``</tool_call>``."""

    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._call: Envelope | EnvelopeList | None = None
        self._calls = 0
        self._broken = False

    def step(self, s: ToolCallStream) -> Status:
        while True:
            if self._broken:
                return _close_marker(s, self.CLOSE)
            if self._call is not None:
                status = self._call.step(s)
                if status is Status.NEED:
                    return status
                self._call = None
                if status is Status.FAIL:
                    if not s.call_open():
                        return Status.FAIL
                    self._broken = True
                    continue
                self._calls += 1
            status = s.skip_ws()
            if status is Status.FAIL and self._calls:
                return Status.DONE  # the reply ended after a complete call
            if status is not None:
                return status
            if s.text[s.pos] == "{":
                self._call = Envelope(require_args=False)
                continue
            if s.text[s.pos] == "[":
                self._call = EnvelopeList(require_args=False)
                continue
            return _close_marker(s, self.CLOSE) if self._calls else Status.FAIL


class _FunctionBlock:
    """After ``<function=``: ``name>``, an arguments object, then ``</function>``."""

    CLOSE = "</function>"

    def __init__(self) -> None:
        self._call = _BareCall((">",))
        self._stage = _Stage.CALL

    def step(self, s: ToolCallStream) -> Status:
        if self._stage is _Stage.CALL:
            status = self._call.step(s)
            if status is Status.NEED:
                return status
            if status is Status.FAIL:
                if not s.call_open():
                    return Status.FAIL
                self._stage = _Stage.BROKEN
            else:
                self._stage = _Stage.CLOSE
        if self._stage is _Stage.BROKEN:
            return _close_marker(s, self.CLOSE)
        status = s.skip_ws()
        if status is Status.FAIL:
            return Status.DONE  # the reply ended after the call
        return status or _close_marker(s, self.CLOSE)


class _LlamaJsonBlock:
    """Call objects (with ``"parameters"`` or ``"arguments"``) separated by ``;`` or whitespace."""

    def __init__(self) -> None:
        self._call: Envelope | None = None
        self._calls = 0
        self._after_separator = False

    def step(self, s: ToolCallStream) -> Status:
        while True:
            if self._call is not None:
                status = self._call.step(s)
                if status is not Status.DONE:
                    return status
                self._call, self._calls = None, self._calls + 1
                self._after_separator = False
            status = s.skip_ws()
            if status is not None:
                return Status.DONE if status is Status.FAIL and self._calls else status
            char = s.text[s.pos]
            if char == "{":
                self._call = Envelope(require_args=True)
            elif char == ";" and self._calls and not self._after_separator:
                s.pos += 1
                self._after_separator = True
            elif self._calls:
                return Status.DONE  # what follows the calls is content
            else:
                return Status.FAIL


class _JsonBlock:
    """The reply is a call object, a list of them, or ``{"tool_calls": [...]}``."""

    def __init__(self, first: str) -> None:
        self._sub: Block
        if first == "[":
            self._sub = EnvelopeList(require_args=True)
        else:
            self._sub = Envelope(require_args=True, wrapper_ok=True)

    def step(self, s: ToolCallStream) -> Status:
        return self._sub.step(s)


class MistralParser(ToolParser):
    """Mistral, Mixtral, Ministral, Devstral, Magistral: ``[TOOL_CALLS]``, old and new forms."""

    name = "mistral"
    markers: ClassVar[Mapping[str, Callable[[], Block]]] = {"[TOOL_CALLS]": _MistralBlock}

    def new_id(self) -> str:
        return mistral_call_id()


class HermesParser(ToolParser):
    """Hermes 2 Pro / 3, Qwen 2.5 / 3 (JSON form): ``<tool_call>{...}</tool_call>``."""

    name = "hermes"
    markers: ClassVar[Mapping[str, Callable[[], Block]]] = {"<tool_call>": _HermesBlock}


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3 custom tools: JSON calls opening the reply or after ``<|python_tag|>``."""

    name = "llama3_json"
    markers: ClassVar[Mapping[str, Callable[[], Block]]] = {"<|python_tag|>": _LlamaJsonBlock}

    def opener(self) -> Callable[[str], Block | None] | None:
        return lambda char: _LlamaJsonBlock() if char == "{" else None


class Llama3FunctionParser(ToolParser):
    """Llama 3.1's documented alternative, also Functionary v3.1: ``<function=name>{...}</function>``."""

    name = "llama3_function"
    markers: ClassVar[Mapping[str, Callable[[], Block]]] = {"<function=": _FunctionBlock}


class JsonParser(ToolParser):
    """Any model told to answer with JSON: the whole reply is the call(s)."""

    name = "json"

    def opener(self) -> Callable[[str], Block | None] | None:
        return lambda char: _JsonBlock(char) if char in "{[" else None
