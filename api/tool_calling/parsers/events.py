"""What tool parsers produce: tool calls, a parsed reply, and the events of a stream."""

from __future__ import annotations

import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    """A fresh call id shaped like OpenAI's: ``call_`` and 24 random letters or digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def mistral_call_id() -> str:
    """A fresh call id of 9 random letters or digits.

    Mistral's chat templates and ``mistral_common`` reject any other shape when the call comes back
    in the conversation history, so the client must be given ids they will accept.
    """
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is JSON text (see the package docstring for its exact form)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """The call as an item of OpenAI's ``message.tool_calls``."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ParsedOutput:
    """A whole reply split into its text (None when there is none) and its tool calls; and its
    reasoning, for formats that carry it in their own markup (harmony), else None."""

    content: str | None
    tool_calls: list[ToolCall]
    reasoning: str | None = None


@dataclass(frozen=True)
class ContentDelta:
    """Reply text that is final and is no part of tool-call markup."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of tool call ``index``: the first one carries ``id`` and ``name`` (and no arguments),
    the later ones carry only a fragment of the arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        """The delta as an item of OpenAI's streamed ``delta.tool_calls``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text of a format that marks it itself (harmony's ``analysis`` channel)."""

    text: str


StreamEvent = ContentDelta | ToolCallDelta | ReasoningDelta


def collect(events: Iterable[StreamEvent]) -> ParsedOutput:
    """Reassemble a stream's events into the reply they describe, as a client would."""
    content: list[str] = []
    reasoning: list[str] = []
    heads: dict[int, ToolCallDelta] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif event.id is not None:
            heads[event.index] = event
            arguments[event.index] = [event.arguments]
        else:
            arguments[event.index].append(event.arguments)
    calls = [
        ToolCall(head.id or "", head.name or "", "".join(arguments[index]))
        for index, head in sorted(heads.items())
    ]
    return ParsedOutput("".join(content) or None, calls, "".join(reasoning) or None)
