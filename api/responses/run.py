"""One /v1/responses request, turn by turn, with the MCP calls between turns run here.

1. ``begin`` starts the first model turn as a chat request (``api.generation.chat_start``): the
   conversation (``instructions`` first, as a system message), the tools and the sampling
   fields, with ``max_output_tokens`` as the completion budget. A request the chat path refuses
   is a 400 before anything is sent, with the Responses field named (``input``,
   ``max_output_tokens``).
2. ``events`` yields the stream: ``response.created`` and ``response.in_progress``, each turn's
   items (``api.responses.turn``), then ``response.completed`` or ``response.incomplete``.
3. After a turn: calls to client functions, a reply without calls, or a reply cut off end the
   response. MCP calls alone start the next turn, with the results in the conversation. The
   first turn uses the request's ``tool_choice``; later ones ``auto``, and once
   ``mcp_max_rounds`` turns have called MCP tools, ``none``, so the model answers. The budget
   ``max_output_tokens`` is shared by all turns; when it runs out the response is
   ``incomplete``.
4. The finished conversation goes into the ``ResponseStore`` (unless ``store`` is false) for a
   later ``previous_response_id``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request

from jax_llm_runtime.api.generation.chat_start import ChatStart, start_chat
from jax_llm_runtime.api.mcp.client import McpClients
from jax_llm_runtime.api.protocol.bodies import ChatCompletionRequest, ChatMessage, Usage
from jax_llm_runtime.api.protocol.errors import APIError
from jax_llm_runtime.api.responses.bodies import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputTokensDetails,
    ResponseCompleted,
    ResponseCreated,
    ResponseEvent,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from jax_llm_runtime.api.responses.items import (
    chat_tool_choice,
    responses_tool_choice,
    responses_tools,
)
from jax_llm_runtime.api.responses.store import ResponseStore, StoredResponse
from jax_llm_runtime.api.responses.turn import Turn, item_id
from jax_llm_runtime.api.service.metrics import Metrics
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.interface import EngineClient

# Chat field names in errors of a turn, as the Responses request calls them.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


@dataclass(frozen=True)
class RunContext:
    """What every turn needs from the app."""

    request: Request[Any, Any, Any]
    engine: EngineClient
    config: ServerConfig
    metrics: Metrics
    mcp: McpClients
    store: ResponseStore


@contextmanager
def responses_params() -> Iterator[None]:
    """Rename the chat fields an ``APIError`` names to the Responses ones."""
    try:
        yield
    except APIError as exc:
        if exc.param is not None and exc.param.startswith("messages"):
            exc.param = "input"
        elif exc.param in _PARAMS:
            exc.param = _PARAMS[exc.param]
        raise


class ResponseRun:
    """A /v1/responses request from its first turn to its stored conversation."""

    def __init__(
        self,
        context: RunContext,
        body: ResponsesRequest,
        history: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
    ) -> None:
        self._context = context
        self._body = body
        self._tools = tools
        self._mcp_tools = {t.name: t for t in context.mcp.tools} if body.tools is None else {}
        self.messages = history  # the conversation so far, instructions aside
        self._sequence = 0
        self._usage = ResponseUsage(0, 0, 0)
        self._first: ChatStart | None = None
        self.response = ResponseObject(
            id=item_id("resp"),
            created_at=int(time.time()),
            model=context.engine.model_name,
            status="in_progress",
            output=[],
            output_text="",
            tools=responses_tools(tools),
            tool_choice=responses_tool_choice(body.tool_choice),
            parallel_tool_calls=body.parallel_tool_calls is not False,
            store=body.store,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id,
            temperature=body.temperature,
            top_p=body.top_p,
            metadata=dict(body.metadata or {}),
        )

    async def begin(self) -> None:
        """Start the first turn (APIError when the request cannot run)."""
        self._first = await self._start(chat_tool_choice(self._body.tool_choice), 0)

    async def _start(self, tool_choice: Any, turn: int) -> ChatStart:
        messages = self.messages
        if self._body.instructions is not None:
            messages = [ChatMessage(role="system", content=self._body.instructions), *messages]
        chat = ChatCompletionRequest(
            messages=messages,
            temperature=self._body.temperature,
            top_p=self._body.top_p,
            max_completion_tokens=self._budget_left(),
            tools=self._tools,
            tool_choice=tool_choice,
            parallel_tool_calls=self._body.parallel_tool_calls,
        )
        c = self._context
        with responses_params():
            return await start_chat(
                c.request, c.engine, c.config, c.metrics, chat, f"{self.response.id}-{turn}"
            )

    def _budget_left(self) -> int | None:
        if self._body.max_output_tokens is None:
            return None
        return self._body.max_output_tokens - self._usage.output_tokens

    def _stamp(self, event: ResponseEvent) -> ResponseEvent:
        event.sequence_number = self._sequence
        self._sequence += 1
        return event

    def _snapshot(self) -> ResponseObject:
        return msgspec.structs.replace(self.response, output=list(self.response.output))

    async def events(self) -> AsyncIterator[ResponseEvent]:
        """The stream's events, from ``response.created`` to the last; call ``begin`` first."""
        if self._first is None:
            raise RuntimeError("ResponseRun.begin was not awaited")
        started, self._first = self._first, None
        yield self._stamp(ResponseCreated(response=self._snapshot()))
        yield self._stamp(ResponseInProgress(response=self._snapshot()))
        rounds = self._context.config.mcp_max_rounds
        incomplete = False
        for turn_number in range(rounds + 1):  # every turn but the last may call MCP tools
            turn = Turn(self.response.output, self._context.mcp, self._mcp_tools)
            async for event in turn.run(started.choices[0]):
                yield self._stamp(event)
            self._count(turn.usage)
            self.messages = [*self.messages, *turn.messages()]
            left = self._budget_left()
            incomplete = turn.finish_reason == "length" or (left is not None and left < 1)
            if incomplete or turn.client_calls or not turn.mcp_calls:
                break
            choice = "auto" if turn_number + 1 < rounds else "none"
            started = await self._start(choice, turn_number + 1)
        self._finish(incomplete)
        final = self._snapshot()
        yield self._stamp(
            ResponseIncomplete(response=final) if incomplete else ResponseCompleted(response=final)
        )

    def _count(self, usage: Usage | None) -> None:
        if usage is None:
            return
        total = self._usage
        self._usage = ResponseUsage(
            input_tokens=total.input_tokens + usage.prompt_tokens,
            output_tokens=total.output_tokens + usage.completion_tokens,
            total_tokens=total.total_tokens + usage.total_tokens,
            input_tokens_details=InputTokensDetails(
                total.input_tokens_details.cached_tokens + usage.prompt_tokens_details.cached_tokens
            ),
            output_tokens_details=OutputTokensDetails(
                total.output_tokens_details.reasoning_tokens
                + usage.completion_tokens_details.reasoning_tokens
            ),
        )

    def _finish(self, incomplete: bool) -> None:
        response = self.response
        response.status = "incomplete" if incomplete else "completed"
        if incomplete:
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        response.usage = self._usage
        response.output_text = "".join(
            part.text
            for item in response.output
            if isinstance(item, OutputMessage)
            for part in item.content
        )
        if self._body.store:
            self._context.store.put(response.id, StoredResponse(tuple(self.messages)))

    async def aclose(self) -> None:
        """Close a first turn that ``events`` never began (its engine streams abort)."""
        started, self._first = self._first, None
        for choice in started.choices if started is not None else []:
            await choice.aclose()

    async def complete(self) -> ResponseObject:
        """Run every turn without streaming; the finished response."""
        async for _ in self.events():
            pass
        return self.response
