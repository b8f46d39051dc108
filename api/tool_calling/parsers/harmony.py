"""gpt-oss replies in OpenAI's harmony format: messages on channels, calls by recipient.

``HarmonyLexer`` cuts a reply into messages as it streams: the header (role, channel,
recipient, content type) once its ``<|message|>`` arrives, then the body as it arrives, then the
end token. Two readers use it: ``HarmonyStream`` (the ``openai`` tool parser) and the reasoning
split of the chat route (``api.generation.reasoning``), which passes the messages to a recipient
through verbatim so that this parser reads them after it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass

from jax_llm_runtime.api.tool_calling.parsers.events import (
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    StreamEvent,
    ToolCallDelta,
    collect,
)
from jax_llm_runtime.api.tool_calling.parsers.stream import JSON_WS, ToolParser

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END_TOKENS = ("<|end|>", "<|call|>", "<|return|>")
_OPENERS = (START, CHANNEL)
# A header longer than this without its <|message|> is no header.
MAX_HEADER_CHARS = 512
FUNCTIONS = "functions."
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,256}")
_ROLE = re.compile(r"[^\s<]+")
_PARTS = re.compile(r"<\|channel\|>([^\s<]*)|(?<!\S)to=([^\s<]*)|<\|constrain\|>([^\s<]*)")


@dataclass(frozen=True)
class Header:
    """A message's header. ``raw`` is its text, from its first marker through ``<|message|>``."""

    role: str
    channel: str
    recipient: str
    content_type: str
    raw: str


def parse_header(raw: str) -> Header | None:
    """The header written in ``raw`` (which ends with ``<|message|>``); None when it is malformed.

    ``[<|start|>ROLE] [to=R] <|channel|>C [to=R] [<|constrain|>T | T]``, in any order after the
    role, separated by whitespace where no marker separates them.
    """
    body = raw[: -len(MESSAGE)]
    role = "assistant"  # the prompt ends with <|start|>assistant; the reply opens with its channel
    if body.startswith(START):
        found = _ROLE.match(body, len(START))
        if found is None:
            return None
        role, body = found.group(), body[found.end() :]
    channel = recipient = content_type = None
    rest = []
    at = 0
    for part in _PARTS.finditer(body):
        rest.append(body[at : part.start()])
        at = part.end()
        c, r, t = part.groups()
        if c is not None:
            if channel is not None or not c:
                return None
            channel = c
        elif r is not None:
            if recipient is not None or not r:
                return None
            recipient = r
        elif content_type is not None or not t:
            return None
        else:
            content_type = t
    words = "".join([*rest, body[at:]]).split()
    if len(words) > 1 or any("<|" in word for word in words) or (words and content_type):
        return None
    if channel is None and recipient is None:
        return None
    if words:  # `json` written without <|constrain|>
        content_type = words[0]
    return Header(role, channel or "", recipient or "", content_type or "", raw)


class Kind(enum.Enum):
    TEXT = "text"  # outside any message (a model that left the format, or broken markup)
    OPEN = "open"  # a message's header is complete
    BODY = "body"
    CLOSE = "close"  # ``text`` is its end token, or "" where the next message or the reply began


@dataclass(frozen=True)
class Segment:
    kind: Kind
    text: str = ""
    header: Header | None = None


class _At(enum.Enum):
    OUTSIDE = "outside"
    HEADER = "header"
    BODY = "body"


def _partial_len(text: str, start: int, markers: tuple[str, ...]) -> int:
    """The longest end of ``text[start:]`` that one of ``markers`` could still grow from."""
    tail = text[max(start, len(text) - 16) :]
    for size in range(len(tail), 0, -1):
        if any(len(m) > size and m.startswith(tail[-size:]) for m in markers):
            return size
    return 0


class HarmonyLexer:
    """Cuts harmony text into segments as it arrives; every cut is decided by the text alone."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self._at = _At.OUTSIDE
        self._header_start = 0
        self._final = False

    def feed(self, delta: str, final: bool = False) -> list[Segment]:
        """Add text (``final``: the reply ended); return the segments it made final."""
        self.text += delta
        self._final = self._final or final
        out: list[Segment] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[Segment]) -> bool:
        if self._at is _At.OUTSIDE:
            return self._outside(out)
        if self._at is _At.HEADER:
            return self._header(out)
        return self._body(out)

    def _find(self, markers: tuple[str, ...]) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for marker in markers:
            index = self.text.find(marker, self.pos)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, marker)
        return best

    def _release(self, out: list[Segment], kind: Kind, markers: tuple[str, ...]) -> None:
        """Send the text up to where a marker could still start."""
        hold = 0 if self._final else _partial_len(self.text, self.pos, markers)
        end = len(self.text) - hold
        if end > self.pos:
            out.append(Segment(kind, self.text[self.pos : end]))
        self.pos = end

    def _outside(self, out: list[Segment]) -> bool:
        found = self._find(_OPENERS)
        if found is None:
            self._release(out, Kind.TEXT, _OPENERS)
            return False
        index, marker = found
        if index > self.pos:
            out.append(Segment(Kind.TEXT, self.text[self.pos : index]))
        self._header_start, self.pos, self._at = index, index + len(marker), _At.HEADER
        return True

    def _header(self, out: list[Segment]) -> bool:
        start = self._header_start
        limit = start + MAX_HEADER_CHARS + len(MESSAGE)
        index = self.text.find(MESSAGE, self.pos, limit)
        if index < 0 and not self._final and len(self.text) < limit:
            return False
        raw = self.text[start : index + len(MESSAGE)] if index >= 0 else ""
        header = parse_header(raw) if raw else None
        if header is None:  # as if its first marker had been ordinary text
            opener = START if self.text.startswith(START, start) else CHANNEL
            out.append(Segment(Kind.TEXT, opener))
            self.pos, self._at = start + len(opener), _At.OUTSIDE
            return True
        out.append(Segment(Kind.OPEN, header=header))
        self.pos, self._at = index + len(MESSAGE), _At.BODY
        return True

    def _body(self, out: list[Segment]) -> bool:
        found = self._find(END_TOKENS + _OPENERS)
        if found is None:
            self._release(out, Kind.BODY, END_TOKENS + _OPENERS)
            if not self._final:
                return False
            out.append(Segment(Kind.CLOSE))
            self._at = _At.OUTSIDE
            return False
        index, marker = found
        if index > self.pos:
            out.append(Segment(Kind.BODY, self.text[self.pos : index]))
        ended = marker in END_TOKENS  # else the next message began without an end token
        self.pos = index + len(marker) if ended else index
        out.append(Segment(Kind.CLOSE, marker if ended else ""))
        self._at = _At.OUTSIDE
        return True


class Route(enum.Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    CALL = "call"
    DROP = "drop"


def route(header: Header) -> Route:
    """Where a message's body goes: a call to ``functions.NAME`` (on any channel) is a tool call;
    one to another recipient (a built-in tool such as ``browser.search`` or ``python``, which
    this server does not run) is dropped; ``analysis`` is reasoning; the rest is content."""
    if header.recipient:
        name = header.recipient.removeprefix(FUNCTIONS)
        if header.recipient.startswith(FUNCTIONS) and _NAME.fullmatch(name):
            return Route.CALL
        return Route.DROP
    return Route.REASONING if header.channel == "analysis" else Route.CONTENT


class HarmonyStream:
    """The ``openai`` parser's stream: ``feed`` / ``finish`` / ``call_open`` as ``ToolCallStream``.

    Content, reasoning and arguments are the message bodies verbatim, except that the arguments
    drop the whitespace around the body (held until text follows it, as in other formats).
    """

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._lexer = HarmonyLexer()
        self._new_id = new_id
        self._route = Route.CONTENT
        self._calls = 0
        self._held_ws = ""
        self._args_sent = False
        self._finished = False

    def feed(self, delta: str) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish(): start a new stream for a new reply")
        return self._events(self._lexer.feed(delta))

    def finish(self) -> list[StreamEvent]:
        if self._finished:
            return []
        self._finished = True
        return self._events(self._lexer.feed("", final=True))

    def call_open(self) -> bool:
        return self._route is Route.CALL

    def _events(self, segments: list[Segment]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for segment in segments:
            if segment.kind is Kind.TEXT:
                events.append(ContentDelta(segment.text))
            elif segment.kind is Kind.OPEN:
                assert segment.header is not None
                self._open(segment.header, events)
            elif segment.kind is Kind.BODY:
                self._body(segment.text, events)
            else:
                if self._route is Route.CALL and not self._args_sent:
                    events.append(ToolCallDelta(self._calls - 1, "{}"))
                self._route = Route.CONTENT
        return _merged(events)

    def _open(self, header: Header, events: list[StreamEvent]) -> None:
        self._route = route(header)
        if self._route is Route.CALL:
            name = header.recipient.removeprefix(FUNCTIONS)
            events.append(ToolCallDelta(self._calls, "", id=self._new_id(), name=name))
            self._calls += 1
            self._held_ws, self._args_sent = "", False

    def _body(self, text: str, events: list[StreamEvent]) -> None:
        if self._route is Route.CONTENT:
            events.append(ContentDelta(text))
        elif self._route is Route.REASONING:
            events.append(ReasoningDelta(text))
        elif self._route is Route.CALL:
            text = self._held_ws + text
            if not self._args_sent:
                text = text.lstrip(JSON_WS)
            solid = text.rstrip(JSON_WS)
            self._held_ws = text[len(solid) :]
            if solid:
                events.append(ToolCallDelta(self._calls - 1, solid))
                self._args_sent = True


def _merged(events: list[StreamEvent]) -> list[StreamEvent]:
    """Neighbouring events of one kind (and call) as one."""
    out: list[StreamEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallDelta)
            and isinstance(last, ToolCallDelta)
            and event.id is None
            and last.id is None
            and event.index == last.index
        ):
            out[-1] = ToolCallDelta(event.index, last.arguments + event.arguments)
        else:
            out.append(event)
    return out


class HarmonyParser(ToolParser):
    """gpt-oss: harmony messages; ``analysis`` is reasoning, ``final`` and preambles content,
    ``to=functions.NAME`` a call."""

    name = "openai"

    def stream(self) -> HarmonyStream:  # type: ignore[override]
        return HarmonyStream(self.new_id)

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        return collect(stream.feed(text) + stream.finish())
