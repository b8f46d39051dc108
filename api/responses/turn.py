"""One model turn of a /v1/responses request: its pieces as output items and stream events.

Text opens a ``message`` item (with one ``output_text`` part); a call of one of the request's MCP
tools opens an ``mcp_call`` item, any other call a ``function_call`` item for the client. The
open item closes when the next one opens or the turn ends: a message with its text, a function
call with its arguments, and an MCP call once the server has run it (``McpClients.call``, which
never raises), so its item carries the output or the error. Items are never changed in place:
a closed item replaces the open one in the response's ``output``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jax_llm_runtime.api.generation.stream import TextPiece
from jax_llm_runtime.api.mcp.client import McpClients, McpResult, McpTool
from jax_llm_runtime.api.protocol.bodies import ChatMessage, FunctionCall, ToolCallParam, Usage
from jax_llm_runtime.api.responses.bodies import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    McpCallArgumentsDelta,
    McpCallArgumentsDone,
    McpCallCompleted,
    McpCallFailed,
    McpCallInProgress,
    McpCallItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ResponseEvent,
)
from jax_llm_runtime.api.tool_calling.parsers import ToolCallDelta


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _OpenMessage:
    index: int  # in the response's output
    id: str
    parts: list[str] = field(default_factory=list)


@dataclass
class _OpenCall:
    index: int
    id: str
    call_id: str
    name: str  # as the model wrote it
    tool: McpTool | None  # None: a client function
    parts: list[str] = field(default_factory=list)
    result: McpResult | None = None

    @property
    def arguments(self) -> str:
        return "".join(self.parts)


class Turn:
    """Reads one turn's pieces into ``output`` (the response's list, appended in place)."""

    def __init__(
        self, output: list[OutputItem], mcp: McpClients, mcp_tools: dict[str, McpTool]
    ) -> None:
        self._output = output
        self._mcp = mcp
        self._mcp_tools = mcp_tools  # the MCP tools this request offered, by the model's name
        self._open: _OpenMessage | _OpenCall | None = None
        self._by_index: dict[int, _OpenCall] = {}
        self._text: list[str] = []
        self.calls: list[_OpenCall] = []  # closed calls, in order
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    @property
    def mcp_calls(self) -> list[_OpenCall]:
        return [call for call in self.calls if call.tool is not None]

    @property
    def client_calls(self) -> list[_OpenCall]:
        return [call for call in self.calls if call.tool is None]

    async def run(self, choice: Any) -> AsyncIterator[ResponseEvent]:
        """The events of ``choice``'s pieces (``pieces()``/``aclose()``), MCP calls run."""
        try:
            async for piece in choice.pieces():
                async for event in self._piece(piece):
                    yield event
            async for event in self._close():
                yield event
        finally:
            await choice.aclose()

    async def _piece(self, piece: TextPiece) -> AsyncIterator[ResponseEvent]:
        if piece.text:
            async for event in self._add_text(piece.text):
                yield event
        for delta in piece.tool_calls:
            async for event in self._add_call(delta):
                yield event
        if piece.finish_reason is not None:
            self.finish_reason, self.usage = piece.finish_reason, piece.usage

    async def _add_text(self, text: str) -> AsyncIterator[ResponseEvent]:
        if not isinstance(self._open, _OpenMessage):
            async for event in self._close():
                yield event
            message = _OpenMessage(len(self._output), item_id("msg"))
            item = OutputMessage(id=message.id, status="in_progress", content=[])
            self._open = message
            self._output.append(item)
            yield OutputItemAdded(output_index=message.index, item=item)
            yield ContentPartAdded(
                item_id=message.id,
                output_index=message.index,
                content_index=0,
                part=OutputText(text=""),
            )
        message = self._open
        message.parts.append(text)
        self._text.append(text)
        yield OutputTextDelta(
            item_id=message.id, output_index=message.index, content_index=0, delta=text
        )

    async def _add_call(self, delta: ToolCallDelta) -> AsyncIterator[ResponseEvent]:
        if delta.id is None:  # a fragment of the arguments of a call already open
            call = self._by_index[delta.index]
            call.parts.append(delta.arguments)
            kind = FunctionCallArgumentsDelta if call.tool is None else McpCallArgumentsDelta
            yield kind(item_id=call.id, output_index=call.index, delta=delta.arguments)
            return
        async for event in self._close():
            yield event
        name = delta.name or ""
        tool = self._mcp_tools.get(name)
        call = _OpenCall(
            len(self._output), item_id("fc" if tool is None else "mcp"), delta.id, name, tool
        )
        call.parts.append(delta.arguments)
        item: OutputItem = FunctionCallItem(
            id=call.id, call_id=call.call_id, name=name, arguments="", status="in_progress"
        )
        if tool is not None:
            item = McpCallItem(
                id=call.id,
                server_label=tool.server,
                name=tool.tool,
                arguments="",
                status="in_progress",
            )
        self._open = self._by_index[delta.index] = call
        self._output.append(item)
        yield OutputItemAdded(output_index=call.index, item=item)
        if delta.arguments:  # a head merged with its first fragments (``api.tool_calling.chat``)
            kind = FunctionCallArgumentsDelta if tool is None else McpCallArgumentsDelta
            yield kind(item_id=call.id, output_index=call.index, delta=delta.arguments)

    async def _close(self) -> AsyncIterator[ResponseEvent]:
        open_item, self._open = self._open, None
        if isinstance(open_item, _OpenMessage):
            for event in self._close_message(open_item):
                yield event
        elif isinstance(open_item, _OpenCall):
            self.calls.append(open_item)
            events = self._close_function if open_item.tool is None else self._close_mcp
            async for event in events(open_item):
                yield event

    def _close_message(self, message: _OpenMessage) -> list[ResponseEvent]:
        text = "".join(message.parts)
        status = "incomplete" if self.finish_reason == "length" else "completed"
        part = OutputText(text=text)
        item = OutputMessage(id=message.id, status=status, content=[part])
        self._output[message.index] = item
        where: dict[str, Any] = {"item_id": message.id, "output_index": message.index}
        return [
            OutputTextDone(**where, content_index=0, text=text),
            ContentPartDone(**where, content_index=0, part=part),
            OutputItemDone(output_index=message.index, item=item),
        ]

    async def _close_function(self, call: _OpenCall) -> AsyncIterator[ResponseEvent]:
        item = FunctionCallItem(
            id=call.id,
            call_id=call.call_id,
            name=call.name,
            arguments=call.arguments,
            status="completed",
        )
        self._output[call.index] = item
        yield FunctionCallArgumentsDone(
            item_id=call.id, output_index=call.index, arguments=call.arguments, name=call.name
        )
        yield OutputItemDone(output_index=call.index, item=item)

    async def _close_mcp(self, call: _OpenCall) -> AsyncIterator[ResponseEvent]:
        assert call.tool is not None
        where: dict[str, Any] = {"item_id": call.id, "output_index": call.index}
        yield McpCallArgumentsDone(**where, arguments=call.arguments)
        yield McpCallInProgress(**where)
        result = call.result = await self._mcp.call(call.tool, call.arguments)
        item = McpCallItem(
            id=call.id,
            server_label=call.tool.server,
            name=call.tool.tool,
            arguments=call.arguments,
            status="failed" if result.error else "completed",
            output=None if result.error else result.text,
            error=result.error,
        )
        self._output[call.index] = item
        yield McpCallFailed(**where) if result.error else McpCallCompleted(**where)
        yield OutputItemDone(output_index=call.index, item=item)

    def messages(self) -> list[ChatMessage]:
        """The turn as chat messages: the assistant's (text and calls), then the MCP results."""
        calls = [
            ToolCallParam(id=c.call_id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in self.calls
        ]
        text = "".join(self._text)
        assistant = ChatMessage(
            role="assistant", content=text or (None if calls else ""), tool_calls=calls or None
        )
        results = [
            ChatMessage(role="tool", content=c.result.text, tool_call_id=c.call_id)
            for c in self.mcp_calls
            if c.result is not None
        ]
        return [assistant, *results]
