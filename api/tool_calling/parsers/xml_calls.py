"""Formats whose arguments are one element per parameter: GLM 4.5+, Qwen3-Coder / Qwen3.5, MiniMax-M2.

The grammars are in the package docstring. A call is announced once its name is read; each
parameter is sent when its closing tag arrives, as the next member of the arguments object
(``{"key": value`` then ``, "key": value``), and the object closes with the call. Values are
typed by the tool's parameter schema (``schemas.typed_value``), so ``arguments`` is JSON the
parser wrote, not the model: ``json.dumps`` with ``", "`` and ``": "`` separators.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from typing import Any

from jax_llm_runtime.api.tool_calling.parsers.schemas import ParameterSchemas, typed_value
from jax_llm_runtime.api.tool_calling.parsers.stream import (
    Block,
    Status,
    ToolCallStream,
    ToolParser,
)

# Names and keys are short; a longer run without the closing tag is no name.
MAX_NAME_CHARS = 256
_NOT_IN_NAMES = frozenset('<>{}[]"\n\r\t')


class _Args:
    """The arguments object of one announced call, built a parameter at a time."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self._schema = schema
        self._count = 0

    def add(self, s: ToolCallStream, key: str, text: str) -> None:
        value = typed_value(text, self._schema.get(key))
        member = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        s.emit_args(("{" if self._count == 0 else ", ") + member)
        self._count += 1

    def close(self, s: ToolCallStream) -> None:
        s.emit_args("}" if self._count else "{}")
        s.end_call()


def _until(s: ToolCallStream, ends: tuple[str, ...], limit: int | None = None) -> str | Status:
    """The text from ``pos`` to the first of ``ends`` (``pos`` moves to that end, not past it).
    NEED until one arrives; FAIL at the end of the reply, or past ``limit`` characters."""
    best = -1
    for end in ends:
        index = s.text.find(end, s.pos, None if limit is None else s.pos + limit + len(end))
        if index >= 0 and (best < 0 or index < best):
            best = index
    if best < 0:
        if s.final or (limit is not None and len(s.text) - s.pos > limit + max(map(len, ends))):
            return Status.FAIL
        return Status.NEED
    text = s.text[s.pos : best]
    s.pos = best
    return text


def _marker(s: ToolCallStream, options: tuple[str, ...]) -> str | Status:
    """Which of ``options`` starts at ``pos`` (``pos`` moves past it); NEED while the text so
    far is a prefix of one, else FAIL."""
    need = False
    for option in options:
        found = s.marker_at(option)
        if found is Status.DONE:
            s.pos += len(option)
            return option
        need = need or found is Status.NEED
    return Status.NEED if need and not s.final else Status.FAIL


def _name(s: ToolCallStream, ends: tuple[str, ...], quotes: bool = False) -> str | Status:
    """A function name or parameter key up to one of ``ends``, trimmed (and unquoted)."""
    found = _until(s, ends, MAX_NAME_CHARS)
    if isinstance(found, Status):
        return found
    name = found.strip()
    if quotes and len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        name = name[1:-1].strip()
    if not name or not name.isprintable() or _NOT_IN_NAMES.intersection(name):
        return Status.FAIL
    return name


def _without_partial(text: str, tag: str) -> str:
    """``text`` without an end that is the start of ``tag`` (a closing tag cut off)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return text[:-size]
    return text


def _trim_newline(text: str) -> str:
    """One newline each side off a value: Qwen's template writes ``>\\nVALUE\\n</parameter>``."""
    text = text.removeprefix("\n")
    return text.removesuffix("\n")


class _S(enum.Enum):
    OPEN = "open"  # between calls: the next call's opening tag, or the block's end
    NAME = "name"
    PARAMS = "params"  # between parameters: the next one, or the call's end
    KEY = "key"
    VALUE_OPEN = "value open"
    VALUE = "value"


class _XmlBlock:
    """The reader shared by the three formats; a dialect fills in the tags (see subclasses).

    ``call_open``: tag that opens a call's name (None: the block is one call, name first).
    ``name_ends``: what ends the name; ``param_open`` / ``key_end``: around a parameter's key;
    ``value_open``: the tag after the key, if any; ``value_ends``: what ends a value (the first
    one is its own closing tag, consumed; the others are left for the next step);
    ``call_close`` / ``block_close``: the tags that end a call and the whole block.
    """

    call_open: str | None
    name_ends: tuple[str, ...]
    param_open: str
    key_end: str
    value_open: str | None = None
    value_ends: tuple[str, ...]
    call_close: str
    block_close: str | None
    quoted_names = False

    def __init__(self, schemas: ParameterSchemas) -> None:
        self._schemas = schemas
        self._stage = _S.OPEN if self.call_open is not None else _S.NAME
        self._args: _Args | None = None
        self._key = ""
        self._calls = 0

    def value(self, text: str) -> str:
        """The value of a parameter from the text between its tags."""
        return text.strip()

    def step(self, s: ToolCallStream) -> Status:
        while True:
            status = self._advance(s)
            if status is not None:
                return status

    def _advance(self, s: ToolCallStream) -> Status | None:
        """One stage; None to go on reading."""
        stage = self._stage
        if stage is _S.KEY:
            found = _name(s, (self.key_end,), self.quoted_names)
            if isinstance(found, Status):
                return found
            s.pos += len(self.key_end)
            self._key = found
            self._stage = _S.VALUE_OPEN if self.value_open else _S.VALUE
            return None
        if stage is _S.VALUE:
            found = _until(s, self.value_ends)
            if found is Status.FAIL:  # cut off inside the value: send what there is of it
                found = _without_partial(s.text[s.pos :], self.value_ends[0])
                s.pos = len(s.text)
                assert self._args is not None
                self._args.add(s, self._key, self.value(found))
                return Status.FAIL
            if isinstance(found, Status):
                return found
            if s.text.startswith(self.value_ends[0], s.pos):
                s.pos += len(self.value_ends[0])
            assert self._args is not None
            self._args.add(s, self._key, self.value(found))
            self._stage = _S.PARAMS
            return None
        ws = s.skip_ws()
        if ws is not None:  # the reply ended between tags: after whole calls, the block did too
            return Status.DONE if ws is Status.FAIL and stage is _S.OPEN and self._calls else ws
        if stage is _S.OPEN:
            return self._read_open(s)
        if stage is _S.NAME:
            return self._read_name(s)
        if stage is _S.VALUE_OPEN:
            assert self.value_open is not None
            found = _marker(s, (self.value_open,))
            if isinstance(found, Status):
                return found
            self._stage = _S.VALUE
            return None
        return self._read_params(s)

    def _read_open(self, s: ToolCallStream) -> Status | None:
        assert self.call_open is not None
        closes = () if self.block_close is None or not self._calls else (self.block_close,)
        found = _marker(s, (self.call_open, *closes))
        if isinstance(found, Status):
            return found
        if found == self.call_open:
            self._stage = _S.NAME
            return None
        return Status.DONE

    def _read_name(self, s: ToolCallStream) -> Status | None:
        found = _name(s, self.name_ends, self.quoted_names)
        if isinstance(found, Status):
            return found
        if s.text.startswith(">", s.pos):
            s.pos += 1
        s.commit(found)
        self._args = _Args(self._schemas.get(found, {}))
        self._stage = _S.PARAMS
        return None

    def _read_params(self, s: ToolCallStream) -> Status | None:
        closes = (
            (self.call_close,) if self.block_close is None else (self.call_close, self.block_close)
        )
        found = _marker(s, (self.param_open, *closes))
        if isinstance(found, Status):
            return found
        if found == self.param_open:
            self._stage = _S.KEY
            return None
        assert self._args is not None
        if found == self.block_close and self.call_close != self.block_close:
            self._args.close(s)  # the call's own closing tag was left out
            return Status.DONE
        self._args.close(s)
        self._calls += 1
        if self.call_open is None or self.call_close == self.block_close:
            return Status.DONE
        self._stage = _S.OPEN
        return None


class _QwenBlock(_XmlBlock):
    """After ``<tool_call>``: ``<function=NAME>`` calls of ``<parameter=KEY>`` elements."""

    call_open = "<function="
    name_ends = (">",)
    param_open = "<parameter="
    key_end = ">"
    value_ends = ("</parameter>", "<parameter=", "</function>", "</tool_call>")
    call_close = "</function>"
    block_close: str | None = "</tool_call>"

    def value(self, text: str) -> str:
        return _trim_newline(text)


class _QwenBareBlock(_QwenBlock):
    """After a ``<function=`` with no ``<tool_call>`` before it: one call."""

    call_open = None
    block_close = None


class _GlmBlock(_XmlBlock):
    """After ``<tool_call>``: NAME, then ``<arg_key>`` / ``<arg_value>`` pairs; one call."""

    call_open = None
    name_ends = ("\n", "<arg_key>", "</tool_call>")
    param_open = "<arg_key>"
    key_end = "</arg_key>"
    value_open = "<arg_value>"
    value_ends = ("</arg_value>", "</tool_call>")
    call_close = "</tool_call>"
    block_close = "</tool_call>"


class _MiniMaxBlock(_XmlBlock):
    """After ``<minimax:tool_call>``: ``<invoke name="NAME">`` calls of ``<parameter name="KEY">``."""

    call_open = "<invoke name="
    name_ends = (">",)
    param_open = "<parameter name="
    key_end = ">"
    value_ends = ("</parameter>", "<parameter name=", "</invoke>", "</minimax:tool_call>")
    call_close = "</invoke>"
    block_close = "</minimax:tool_call>"
    quoted_names = True


def _factory(block: type[_XmlBlock], schemas: ParameterSchemas) -> Callable[[], Block]:
    return lambda: block(schemas)


class Qwen3CoderParser(ToolParser):
    """Qwen3-Coder, Qwen3.5, Qwen3-Next, Nemotron 3: ``<tool_call><function=..>`` XML calls."""

    name = "qwen3_coder"

    def blocks(self) -> Mapping[str, Callable[[], Block]]:
        return {
            "<tool_call>": _factory(_QwenBlock, self.schemas),
            "<function=": _factory(_QwenBareBlock, self.schemas),
        }


class Glm45Parser(ToolParser):
    """GLM 4.5 / 4.6 / 4.7, GLM-4-MoE-lite: ``<tool_call>NAME<arg_key>..<arg_value>..``."""

    name = "glm45"

    def blocks(self) -> Mapping[str, Callable[[], Block]]:
        return {"<tool_call>": _factory(_GlmBlock, self.schemas)}


class MiniMaxM2Parser(ToolParser):
    """MiniMax-M2: ``<minimax:tool_call><invoke name=..><parameter name=..>``."""

    name = "minimax_m2"

    def blocks(self) -> Mapping[str, Callable[[], Block]]:
        return {"<minimax:tool_call>": _factory(_MiniMaxBlock, self.schemas)}
