"""Responses API requests to chat terms: ``input`` items to chat messages, tools to chat tools.

The Responses route runs each model turn as a chat request (``api.generation.chat_start``), so the
conversation is kept as ``ChatMessage``s:

- a message item is a chat message (text parts joined by newlines);
- ``function_call`` items join the assistant message right before them as ``tool_calls`` (a new
  assistant message when there is none), as the model wrote them in one turn;
- a ``function_call_output`` is a ``tool`` message answering its ``call_id``;
- an ``mcp_call`` is both: the call, under the name the model saw (``<server>__<tool>``), and a
  ``tool`` message with its output or error.

Missing fields are 400s naming the item, e.g. ``input[2].call_id``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from jax_llm_runtime.api.mcp.client import McpClients, namespaced_names
from jax_llm_runtime.api.protocol.bodies import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    ImageContentPart,
    ImageURL,
    TextContentPart,
    ToolCallParam,
)
from jax_llm_runtime.api.protocol.errors import bad_request
from jax_llm_runtime.api.responses.bodies import (
    InputContentPart,
    InputItem,
    ResponsesRequest,
    ToolChoiceFunction,
)


def _text(value: str | list[InputContentPart]) -> str:
    if isinstance(value, str):
        return value
    return "\n".join(part.text for part in value if part.text is not None)


def _content(value: str | list[InputContentPart]) -> str | list[ContentPart]:
    """A message's content for the chat: its text, or with images its parts in order."""
    if isinstance(value, str) or all(part.image_url is None for part in value):
        return _text(value)
    return [
        ImageContentPart(ImageURL(part.image_url))
        if part.image_url is not None
        else TextContentPart(part.text or "")
        for part in value
    ]


def _need(item: InputItem, index: int, *fields: str) -> None:
    for name in fields:
        if getattr(item, name) is None:
            raise bad_request(
                f"an input item of type {item.type} needs `{name}`", param=f"input[{index}].{name}"
            )


def _with_call(messages: list[ChatMessage], call: ToolCallParam) -> None:
    """Add ``call`` to the assistant message that ends ``messages``, or start one."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        messages[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or []), call])
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def _mcp_call_name(mcp: McpClients, server: str, tool: str) -> str:
    for known in mcp.tools:
        if known.server == server and known.tool == tool:
            return known.name
    return namespaced_names(server, [tool], set())[0]


def _append_item(messages: list[ChatMessage], item: InputItem, index: int, mcp: McpClients) -> None:
    if item.type == "message":
        _need(item, index, "role", "content")
        assert item.role is not None and item.content is not None
        messages.append(ChatMessage(role=item.role, content=_content(item.content)))
    elif item.type == "function_call":
        _need(item, index, "call_id", "name", "arguments")
        function = FunctionCall(name=item.name or "", arguments=item.arguments or "")
        _with_call(messages, ToolCallParam(id=item.call_id or "", function=function))
    elif item.type == "function_call_output":
        _need(item, index, "call_id", "output")
        assert item.output is not None
        messages.append(
            ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id)
        )
    else:  # mcp_call
        _need(item, index, "id", "server_label", "name", "arguments")
        name = _mcp_call_name(mcp, item.server_label or "", item.name or "")
        call_id = item.id or ""
        function = FunctionCall(name=name, arguments=item.arguments or "")
        _with_call(messages, ToolCallParam(id=call_id, function=function))
        output = item.output if item.output is not None else f"Error: {item.error}"
        messages.append(ChatMessage(role="tool", content=_text(output), tool_call_id=call_id))


def input_messages(body: ResponsesRequest, mcp: McpClients) -> list[ChatMessage]:
    """The request's ``input`` as chat messages (a string is one user message)."""
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    messages: list[ChatMessage] = []
    for index, item in enumerate(body.input):
        _append_item(messages, item, index, mcp)
    return messages


def chat_tools(body: ResponsesRequest, mcp: McpClients) -> list[dict[str, Any]] | None:
    """The tools as chat ``tools`` items: the request's functions, or when it sends no
    ``tools`` at all, the MCP tools (None when there are none)."""
    if body.tools is None:
        return mcp.openai_tools() or None
    out = []
    for tool in body.tools:
        function: dict[str, Any] = {"name": tool.name, "description": tool.description or ""}
        function["parameters"] = (
            tool.parameters if tool.parameters is not None else {"type": "object"}
        )
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | ToolChoiceFunction | None) -> str | dict[str, Any] | None:
    """A Responses ``tool_choice`` in the chat shape (a function is nested under ``function``)."""
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def responses_tool_choice(choice: str | ToolChoiceFunction | None) -> str | dict[str, Any]:
    """``tool_choice`` as a response reports it (``auto`` when the request set none)."""
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


def responses_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat ``tools`` items as a response reports them (Responses' flat function shape)."""
    return [{"type": "function", **tool["function"]} for tool in tools or []]
