"""Reasoning models: the text between think markers goes to ``reasoning_content``, not ``content``.

1. ``ReasoningParser`` is a pure, incremental splitter: feed it text pieces as they stream, get
   back the reasoning and content text that is final so far. A piece that could still be the
   start of a marker is held back, so a stream never shows part of a marker in either field.
2. A reply is reasoning when it opens with the start marker (after optional whitespace), or from
   its first token when the rendered prompt already ends with it (templates that open the think
   block themselves); the reasoning ends at the end marker and everything after it is content.
   A marker anywhere else is ordinary text. A reply cut off inside the reasoning (max_tokens)
   is all reasoning.
3. Gemma 4 thinks in a channel, ``<|channel>thought`` ... ``<channel|>``
   (``Gemma4ReasoningParser``): the label ``thought`` and the whitespace after it are markup,
   and a block is reasoning wherever it stands, since the channel markers are special tokens
   that ordinary text cannot hold. A ``<|channel>`` not followed by ``thought``, and a ``<channel|>`` outside a block, are
   dropped (the model writes an empty channel, or a stray end, now and then).
4. gpt-oss marks reasoning by harmony channels instead (``HarmonyReasoningParser``): the
   ``analysis`` messages are reasoning; the other messages' bodies are content, without their
   markup, except messages to a recipient (tool calls), which stay whole for the ``openai``
   tool parser.
5. ``ReasoningPieces`` applies a parser to a ``Generation``'s pieces for the chat route (filling
   ``TextPiece.reasoning``) and counts ``usage.completion_tokens_details.reasoning_tokens``: the
   tokens whose text went to the reasoning (the marker tokens are not counted).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import msgspec

from jax_llm_runtime.api.generation.stream import Generation, TextPiece
from jax_llm_runtime.api.protocol.bodies import Usage
from jax_llm_runtime.api.tool_calling.parsers.harmony import HarmonyLexer, Kind, Route, route
from jax_llm_runtime.runtime.engine.interface import TokenizerLike
from jax_llm_runtime.runtime.engine.request import TokenLogprobs
from jax_llm_runtime.runtime.text.tokenizer import GEMMA4_MARKERS, HARMONY_MARKERS

# Enough prompt tokens to hold a start marker and the whitespace a template puts after it.
_PROMPT_TAIL_TOKENS = 16
CHANNEL_OPEN, CHANNEL_CLOSE, THOUGHT = "<|channel>", "<channel|>", "thought"


class _State(enum.Enum):
    OPENING = "opening"  # nothing but whitespace seen yet: the start marker may still come
    REASONING = "reasoning"
    CONTENT = "content"
    CHANNEL = "channel"  # Gemma 4: just after <|channel>, its name still to come
    LABEL = "label"  # Gemma 4: after the label "thought", the whitespace that ends it


@dataclass(frozen=True)
class ReasoningDelta:
    """Text that became final with one ``feed``: the reasoning part and the content part."""

    reasoning: str
    content: str


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper suffix of ``text`` that is a prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits one reply into reasoning and content; see the module docstring.

    ``in_reasoning``: the prompt already opened the think block, so the reply starts inside it.
    """

    def __init__(self, start: str, end: str, in_reasoning: bool = False) -> None:
        if not start or not end:
            raise ValueError("reasoning markers must be non-empty")
        self.start = start
        self.end = end
        self._state = _State.REASONING if in_reasoning else _State.OPENING
        self._held = ""
        self._pending_tokens = 0  # tokens of held-back text inside the reasoning
        self.reasoning_tokens = 0

    def feed(self, text: str, num_tokens: int = 0) -> ReasoningDelta:
        """Add ``text`` (produced by ``num_tokens`` tokens); return what is final so far."""
        was_reasoning = self._state is _State.REASONING
        reasoning, content = self._split(self._held + text)
        if reasoning:
            self.reasoning_tokens += self._pending_tokens + num_tokens
            self._pending_tokens = 0
        elif was_reasoning and self._state is _State.REASONING:
            self._pending_tokens += num_tokens
        else:
            self._pending_tokens = 0
        return ReasoningDelta(reasoning, content)

    def flush(self) -> ReasoningDelta:
        """The reply ended: release held-back text (unfinished reasoning stays reasoning)."""
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            if held:
                self.reasoning_tokens += self._pending_tokens
            self._pending_tokens = 0
            return ReasoningDelta(held, "")
        return ReasoningDelta("", held)

    def _split(self, buf: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state is _State.OPENING:
                stripped = buf.lstrip()
                if stripped.startswith(self.start):
                    self._state, buf = _State.REASONING, stripped[len(self.start) :]
                    continue
                if self.start.startswith(stripped):  # whitespace or a partial start marker
                    self._held = buf
                    break
                self._state = _State.CONTENT
            elif self._state is _State.REASONING:
                index = buf.find(self.end)
                if index >= 0:
                    reasoning.append(buf[:index])
                    self._state, buf = _State.CONTENT, buf[index + len(self.end) :]
                    continue
                keep = _partial_suffix(buf, self.end)
                reasoning.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            else:
                content.append(buf)
                self._held = ""
                break
        return "".join(reasoning), "".join(content)


class Gemma4ReasoningParser(ReasoningParser):
    """Gemma 4's thinking channel; see the module docstring.

    ``in_reasoning``: the prompt already opened the thought block, so the reply starts inside it.
    """

    def __init__(self, in_reasoning: bool = False) -> None:
        super().__init__(*GEMMA4_MARKERS)
        self._state = _State.LABEL if in_reasoning else _State.OPENING

    def flush(self) -> ReasoningDelta:
        """The reply ended: release held-back text (a channel cut off before its text is none)."""
        if self._state in (_State.CHANNEL, _State.LABEL):
            self._held = ""
            return ReasoningDelta("", "")
        return super().flush()

    def _split(self, buf: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            state = self._state
            if state is _State.CHANNEL:
                if buf.startswith(THOUGHT):
                    self._state, buf = _State.LABEL, buf[len(THOUGHT) :]
                elif THOUGHT.startswith(buf):  # the name may still be the label
                    self._held = buf
                    break
                else:
                    self._state = _State.CONTENT  # an empty channel: its marker is dropped
            elif state is _State.LABEL:
                buf = buf.lstrip()
                if not buf:
                    self._held = ""
                    break
                self._state = _State.REASONING
            elif state is _State.REASONING:
                index = buf.find(CHANNEL_CLOSE)
                if index < 0:
                    keep = _partial_suffix(buf, CHANNEL_CLOSE)
                    reasoning.append(buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep :]
                    break
                reasoning.append(buf[:index])
                self._state, buf = _State.CONTENT, buf[index + len(CHANNEL_CLOSE) :]
            else:
                rest = self._content_step(buf, content)
                if rest is None:
                    break
                buf = rest
        return "".join(reasoning), "".join(content)

    def _content_step(self, buf: str, content: list[str]) -> str | None:
        """Content up to the next channel marker, and the text after that marker; None when
        there is none yet (the undecided end is held back)."""
        opens, closes = buf.find(CHANNEL_OPEN), buf.find(CHANNEL_CLOSE)
        found = [i for i in (opens, closes) if i >= 0]
        opening = self._state is _State.OPENING
        if not found:
            keep = max(_partial_suffix(buf, CHANNEL_OPEN), _partial_suffix(buf, CHANNEL_CLOSE))
            text = buf[: len(buf) - keep]
            if opening and not text.strip():  # only whitespace yet: a block may still follow
                self._held = buf
                return None
            content.append(text)
            self._held = buf[len(buf) - keep :]
            self._state = _State.CONTENT
            return None
        index = min(found)
        if not (opening and not buf[:index].strip()):  # whitespace before a first block is dropped
            content.append(buf[:index])
        if index == opens:
            self._state = _State.CHANNEL
            return buf[index + len(CHANNEL_OPEN) :]
        self._state = _State.CONTENT  # a stray end marker
        return buf[index + len(CHANNEL_CLOSE) :]


class HarmonyReasoningParser:
    """``ReasoningParser``'s interface over a harmony reply (see the module docstring)."""

    def __init__(self) -> None:
        self._lexer = HarmonyLexer()
        self._route = Route.CONTENT
        self._whole = False  # the open message goes on verbatim, markup and all
        self._pending_tokens = 0
        self.reasoning_tokens = 0

    def feed(self, text: str, num_tokens: int = 0) -> ReasoningDelta:
        """Add ``text`` (produced by ``num_tokens`` tokens); return what is final so far."""
        was_reasoning = self._route is Route.REASONING
        delta = self._split(text, final=False)
        if delta.reasoning:
            self.reasoning_tokens += self._pending_tokens + num_tokens
            self._pending_tokens = 0
        elif was_reasoning and self._route is Route.REASONING:
            self._pending_tokens += num_tokens  # held back: counted once its text comes out
        else:
            self._pending_tokens = 0
        return delta

    def flush(self) -> ReasoningDelta:
        """The reply ended: release what is held (an unfinished analysis stays reasoning)."""
        delta = self._split("", final=True)
        if delta.reasoning:
            self.reasoning_tokens += self._pending_tokens
        self._pending_tokens = 0
        return delta

    def _split(self, text: str, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        for segment in self._lexer.feed(text, final):
            if segment.kind is Kind.OPEN:
                assert segment.header is not None
                self._route = route(segment.header)
                self._whole = bool(segment.header.recipient)
                if self._whole:
                    content.append(segment.header.raw)
            elif segment.kind is Kind.CLOSE:
                if self._whole:
                    content.append(segment.text)
                self._route, self._whole = Route.CONTENT, False
            elif segment.kind is Kind.BODY and self._route is Route.REASONING:
                reasoning.append(segment.text)
            else:
                content.append(segment.text)
        return ReasoningDelta("".join(reasoning), "".join(content))


class Splitter(Protocol):
    """``ReasoningParser`` (or ``Gemma4ReasoningParser``) or ``HarmonyReasoningParser``."""

    reasoning_tokens: int

    def feed(self, text: str, num_tokens: int = 0) -> ReasoningDelta: ...

    def flush(self) -> ReasoningDelta: ...


def _with_reasoning_tokens(usage: Usage, reasoning_tokens: int) -> Usage:
    details = msgspec.structs.replace(
        usage.completion_tokens_details, reasoning_tokens=reasoning_tokens
    )
    return msgspec.structs.replace(usage, completion_tokens_details=details)


class ReasoningPieces:
    """A ``Generation`` whose pieces are split by a ``ReasoningParser`` (or not, when None)."""

    def __init__(self, generation: Generation, parser: Splitter | None) -> None:
        self._generation = generation
        self._parser = parser

    async def aclose(self) -> None:
        """Close the engine stream (aborting the sequence if it is unfinished). Idempotent."""
        await self._generation.aclose()

    async def finish(self, reason: str) -> None:
        """End the reply here with ``reason`` (``Generation.finish``)."""
        await self._generation.finish(reason)

    async def pieces(self) -> AsyncIterator[TextPiece]:
        """Like ``Generation.pieces``, each piece split into reasoning and content."""
        parser = self._parser
        tokens_seen = 0
        logprobs: tuple[TokenLogprobs, ...] = ()
        async for piece in self._generation.pieces():
            if parser is None:
                yield piece
                continue
            num_tokens = piece.usage.completion_tokens - tokens_seen
            tokens_seen = piece.usage.completion_tokens
            delta = parser.feed(piece.text, num_tokens)
            reasoning, content = delta.reasoning, delta.content
            if piece.finish_reason is not None:
                rest = parser.flush()
                reasoning, content = reasoning + rest.reasoning, content + rest.content
            usage = _with_reasoning_tokens(piece.usage, parser.reasoning_tokens)
            logprobs += piece.logprobs  # held until a piece carries text
            if reasoning or content or piece.finish_reason is not None:
                yield TextPiece(content, piece.finish_reason, usage, reasoning, logprobs)
                logprobs = ()

    async def collect(self) -> TextPiece:
        """The whole reply as one piece (reasoning, content, finish reason, final usage)."""
        reasoning: list[str] = []
        content: list[str] = []
        logprobs: list[TokenLogprobs] = []
        last: TextPiece | None = None
        async for piece in self.pieces():
            reasoning.append(piece.reasoning)
            content.append(piece.text)
            logprobs += piece.logprobs
            last = piece
        if last is None:  # pieces() always ends with a finish piece or raises
            raise RuntimeError("the engine stream produced no output")
        joined = "".join(reasoning)
        return TextPiece("".join(content), last.finish_reason, last.usage, joined, tuple(logprobs))


def split_reasoning(
    tokenizer: TokenizerLike, prompt_ids: list[int], generation: Generation
) -> ReasoningPieces:
    """The chat route's view of ``generation``: split by the model's think markers, if it has any.

    The last few prompt tokens tell whether the template already opened the think block.
    """
    markers = tokenizer.reasoning_markers
    if markers is None:
        return ReasoningPieces(generation, None)
    if markers == HARMONY_MARKERS:
        return ReasoningPieces(generation, HarmonyReasoningParser())
    start, end = markers
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    in_reasoning = tail.rstrip().endswith(start)
    if markers == GEMMA4_MARKERS:
        return ReasoningPieces(generation, Gemma4ReasoningParser(in_reasoning))
    return ReasoningPieces(generation, ReasoningParser(start, end, in_reasoning))
