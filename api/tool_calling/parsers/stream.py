"""The incremental machinery every format shares: content outside markup, calls inside it.

``ToolCallStream`` walks the text once, left to right, keeping a position ``pos`` into everything
fed so far. Outside markup it sends content, holding back what could still be the start of a
marker. At a marker (or, for formats without one, at the first character of the reply) it hands
the text to the format's ``Block``, which reads the markup and announces calls through
``commit`` / ``emit_args`` / ``end_call``. A block answers NEED when the text so far cannot decide
the next step: every decision waits for the characters it depends on, so the events reassemble
to the same reply however the text is cut into pieces. ``ToolParser.parse`` is this stream fed
the whole text at once.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Protocol

from jax_llm_runtime.api.tool_calling.parsers.events import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCallDelta,
    collect,
    openai_call_id,
)
from jax_llm_runtime.api.tool_calling.parsers.schemas import parameter_schemas

JSON_WS = " \t\n\r"


class Status(enum.Enum):
    """What one step of a block found."""

    NEED = "need"  # the text so far cannot decide; call again when more arrives
    DONE = "done"  # the part ended well; ``pos`` is just past it
    FAIL = "fail"  # the text at ``pos`` does not fit the format


class Block(Protocol):
    """The reader of one piece of tool markup, from just after its start marker."""

    def step(self, s: ToolCallStream) -> Status:
        """Read from ``s.pos`` as far as the text allows; never NEED once ``s.final`` is set."""
        ...


class _Mode(enum.Enum):
    OPENING = "opening"  # only whitespace so far; the format may open markup on the next char
    CONTENT = "content"
    MARKUP = "markup"


class ToolCallStream:
    """Turns text deltas into content and tool-call events; see the package docstring."""

    def __init__(
        self,
        markers: Mapping[str, Callable[[], Block]],
        opener: Callable[[str], Block | None] | None,
        new_id: Callable[[], str],
    ) -> None:
        self.text = ""  # everything fed so far
        self.pos = 0  # text before it is decided
        self.final = False  # no more text will come
        self._markers = markers
        self.stops = tuple(markers)  # a value being read ends where one of these starts
        self._opener = opener
        self._new_id = new_id
        self._mode = _Mode.OPENING if opener is not None else _Mode.CONTENT
        self._events: list[StreamEvent] = []
        self._finished = False
        # Whitespace is held until what follows it is known (see ``_send_content``).
        self._pending = ""
        self._after_markup = False
        self._content_sent = False
        # The markup block being read.
        self._block: Block | None = None
        self._block_start = 0
        self._marker_end = 0
        self._prefix = ""  # the held whitespace the block's marker followed
        self._block_calls = 0
        self._boundary = 0  # just past the last call that ended in this block
        self._calls = 0
        self._open: int | None = None  # index of the call whose arguments are being sent

    def feed(self, delta: str) -> list[StreamEvent]:
        """Add generated text; return the events it made final."""
        if self._finished:
            raise RuntimeError("feed() after finish(): start a new stream for a new reply")
        self.text += delta
        self._run()
        return self._drain()

    def finish(self) -> list[StreamEvent]:
        """The reply ended: decide everything still held and return the last events."""
        if self._finished:
            return []
        self.final = True
        self._run()
        while self._mode is _Mode.MARKUP:  # a block must decide at the end; undecided is a break
            self._fail_block()
            self._run()
        if self._pending and not self._after_markup:
            self._push(ContentDelta(self._pending))
        self._pending = ""
        self._finished = True
        return self._drain()

    # The interface blocks use.

    def skip_ws(self) -> Status | None:
        """Move past JSON whitespace; None when a character follows, else NEED (or FAIL at the end)."""
        n = len(self.text)
        while self.pos < n and self.text[self.pos] in JSON_WS:
            self.pos += 1
        if self.pos < n:
            return None
        return Status.FAIL if self.final else Status.NEED

    def marker_at(self, marker: str) -> Status:
        """DONE if ``marker`` starts at ``pos``, NEED if the text ends in a prefix of it, else FAIL."""
        if self.text.startswith(marker, self.pos):
            return Status.DONE
        rest = self.text[self.pos : self.pos + len(marker)]
        return Status.NEED if len(rest) < len(marker) and marker.startswith(rest) else Status.FAIL

    def commit(self, name: str) -> None:
        """Announce a new call: its first delta carries a fresh id and the name."""
        index = self._calls
        self._calls += 1
        self._block_calls += 1
        self._open = index
        self._push(ToolCallDelta(index, "", id=self._new_id(), name=name))

    def emit_args(self, fragment: str) -> None:
        """Send the next piece of the open call's arguments."""
        if fragment and self._open is not None:
            self._push(ToolCallDelta(self._open, fragment))

    def end_call(self) -> None:
        """The open call is complete; a later break in this block resumes just past it."""
        self._open = None
        self._boundary = self.pos

    def call_open(self) -> bool:
        """Whether a call has been announced and not yet ended."""
        return self._open is not None

    # Internals.

    def _run(self) -> None:
        while True:
            if self._mode is _Mode.OPENING:
                progressed = self._opening_step()
            elif self._mode is _Mode.CONTENT:
                progressed = self._content_step()
            else:
                progressed = self._markup_step()
            if not progressed:
                return

    def _opening_step(self) -> bool:
        n = len(self.text)
        start = self.pos
        while self.pos < n and self.text[self.pos].isspace():
            self.pos += 1
        self._pending += self.text[start : self.pos]
        if self.pos == n:
            return False
        assert self._opener is not None
        block = self._opener(self.text[self.pos])
        if block is None:
            self._mode = _Mode.CONTENT
        else:
            self._open_block(self.pos, self.pos, block)
        return True

    def _content_step(self) -> bool:
        found = self._find_marker()
        if found is not None:
            start, marker = found
            self._send_content(self.text[self.pos : start])
            self._open_block(start, start + len(marker), self._markers[marker]())
            return True
        hold = 0 if self.final else self._partial_marker_len()
        end = len(self.text) - hold
        self._send_content(self.text[self.pos : end])
        self.pos = end
        return False

    def _markup_step(self) -> bool:
        assert self._block is not None
        status = self._block.step(self)
        if status is Status.NEED:
            return False
        if status is Status.DONE and self._block_calls:
            if self._open is not None:
                self.end_call()
            self._block = None
            self._mode = _Mode.CONTENT
            self._after_markup = True
        else:
            self._fail_block()
        return True

    def _open_block(self, start: int, marker_end: int, block: Block) -> None:
        self._block = block
        self._mode = _Mode.MARKUP
        self._block_start, self._marker_end = start, marker_end
        self._prefix, self._pending = self._pending, ""
        self._block_calls = 0
        self.pos = marker_end

    def _fail_block(self) -> None:
        """The block broke at ``pos``: go back to content; see "Fallback" in the package docstring."""
        self._block = None
        self._mode = _Mode.CONTENT
        if self._open is not None:
            self.end_call()
            self._after_markup = True
        elif self._block_calls:
            self.pos = self._boundary
            self._after_markup = True
        else:  # as if the marker had been ordinary text
            self.pos = self._marker_end
            self._send_content(self._prefix + self.text[self._block_start : self._marker_end])

    def _send_content(self, text: str) -> None:
        """Send content, holding trailing whitespace: it is dropped if markup follows it.

        Whitespace right after markup is sent only when text follows it and content came before.
        """
        body = text.rstrip()
        if not body:
            self._pending += text
            return
        out = self._pending + body
        if self._after_markup and not self._content_sent:
            out = out.lstrip()
        self._after_markup = False
        self._pending = text[len(body) :]
        if out:
            self._content_sent = True
            self._push(ContentDelta(out))

    def _find_marker(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for marker in self._markers:
            index = self.text.find(marker, self.pos)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, marker)
        return best

    def _partial_marker_len(self) -> int:
        """The longest end of the undecided text that a marker could still grow from."""
        longest_marker = max(map(len, self._markers), default=0)
        tail = self.text[max(self.pos, len(self.text) - longest_marker) :]
        longest = 0
        for marker in self._markers:
            for size in range(min(len(tail), len(marker) - 1), longest, -1):
                if marker.startswith(tail[-size:]):
                    longest = size
                    break
        return longest

    def _push(self, event: StreamEvent) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            self._events[-1] = ContentDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallDelta)
            and event.id is None
            and isinstance(last, ToolCallDelta)
            and last.id is None
            and last.index == event.index
        ):
            self._events[-1] = ToolCallDelta(event.index, last.arguments + event.arguments)
        else:
            self._events.append(event)

    def _drain(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        return events


class ToolParser:
    """One model family's tool-call format. Stateless: ``stream()`` holds the state of a reply.

    ``tools``: the request's OpenAI-shaped tools; formats that write arguments as bare text type
    the values by their parameter schemas (``schemas.typed_value``); JSON formats ignore them.
    """

    name: ClassVar[str]
    # Marker text -> the block that reads the markup after it.
    markers: ClassVar[Mapping[str, Callable[[], Block]]] = {}

    def __init__(self, tools: Iterable[Any] | None = None) -> None:
        self.schemas = parameter_schemas(tools)

    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one reply."""
        return ToolCallStream(self.blocks(), self.opener(), self.new_id)

    def blocks(self) -> Mapping[str, Callable[[], Block]]:
        """Marker text -> the block that reads the markup after it (``markers`` unless a format
        needs the request's tools to read its markup)."""
        return self.markers

    def parse(self, text: str) -> ParsedOutput:
        """The whole reply at once: exactly what ``stream()`` gives for it, reassembled."""
        stream = self.stream()
        return collect(stream.feed(text) + stream.finish())

    def opener(self) -> Callable[[str], Block | None] | None:
        """For formats whose markup may open the reply without a marker: the block for a first
        non-whitespace character, or None for ordinary text. None when there is no such rule."""
        return None

    def new_id(self) -> str:
        """A fresh tool call id."""
        return openai_call_id()
