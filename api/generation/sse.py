"""Server-sent events for streamed completions, in the framing OpenAI clients parse.

Each event is ``data: <json>\\n\\n`` (Litestar's default separator is ``\\r\\n``; OpenAI and vLLM use
``\\n``, and some hand-written clients split on ``\\n\\n``), and the stream ends with
``data: [DONE]``. Once the first byte is sent the status is fixed at 200, so a later error is sent
as an event holding the usual error envelope, which the openai SDK raises as an ``APIError``.

When the client disconnects, Litestar cancels the task iterating the events. If that task was
inside the engine stream the cancellation closes it; if it was inside ``send`` the event generator
is left suspended. The response's ASGI callable therefore closes the generator when it returns,
however it returns (Litestar skips its background tasks when sending fails), which closes the
engine stream and aborts the sequence at once rather than whenever it is garbage collected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
from litestar.response import ServerSentEvent, ServerSentEventMessage

from jax_llm_runtime.api.generation.stream import TextPiece, merge_usage
from jax_llm_runtime.api.protocol.bodies import Usage
from jax_llm_runtime.api.protocol.errors import APIError
from jax_llm_runtime.runtime.engine.request import TokenLogprobs

logger = logging.getLogger(__name__)

DONE = "[DONE]"


class Pieces(Protocol):
    """A choice's text pieces (``Generation``, or its reasoning-splitting wrapper)."""

    def pieces(self) -> AsyncIterator[TextPiece]: ...

    async def aclose(self) -> None: ...


class ChunkFactory(Protocol):
    """Builds one endpoint's chunk objects (chat.completion.chunk or text_completion)."""

    def opening(self) -> msgspec.Struct | None:
        """The chunk sent before any text (chat: the assistant role), or None."""
        ...

    def text(self, text: str, logprobs: tuple[TokenLogprobs, ...] = ()) -> msgspec.Struct:
        """A chunk carrying newly generated text (and its tokens' logprobs, when requested)."""
        ...

    def reasoning(self, text: str) -> msgspec.Struct:
        """A chunk carrying newly generated reasoning (chat only: only pieces split by
        ``api.generation.reasoning`` have any)."""
        ...

    def tool_calls(self, calls: list[dict]) -> msgspec.Struct:
        """A chunk carrying ``delta.tool_calls`` items (chat only: only pieces read by
        ``api.tool_calling.chat`` have any)."""
        ...

    def finish(self, finish_reason: str) -> msgspec.Struct:
        """The chunk carrying the finish reason."""
        ...

    def usage(self, usage: Usage) -> msgspec.Struct:
        """The usage chunk (no choices) sent when ``stream_options.include_usage`` is set."""
        ...


def _event(data: msgspec.Struct | str) -> ServerSentEventMessage:
    text = data if isinstance(data, str) else msgspec.json.encode(data).decode()
    return ServerSentEventMessage(data=text, sep="\n")


async def _events(
    choices: list[tuple[Pieces, ChunkFactory]], include_usage: bool, per_prompt: int | None
) -> AsyncGenerator[ServerSentEventMessage, None]:
    try:
        for _, chunks in choices:
            opening = chunks.opening()
            if opening is not None:
                yield _event(opening)
        usages: dict[int, Usage] = {}
        async for index, piece in _merge([generation.pieces() for generation, _ in choices]):
            chunks = choices[index][1]
            if piece.reasoning:
                yield _event(chunks.reasoning(piece.reasoning))
            if piece.text or piece.logprobs:
                yield _event(chunks.text(piece.text, piece.logprobs))
            if piece.tool_calls:
                yield _event(chunks.tool_calls([call.openai() for call in piece.tool_calls]))
            if piece.finish_reason is not None:
                yield _event(chunks.finish(piece.finish_reason))
                usages[index] = piece.usage
        if include_usage:
            ordered = [usages[i] for i in sorted(usages)]
            yield _event(choices[0][1].usage(merge_usage(ordered, per_prompt)))
    except APIError as exc:
        yield _event(exc.body())
    except Exception as exc:  # the stream is the only channel left to tell the client
        logger.exception("error while streaming a completion", exc_info=exc)
        yield _event(APIError(500, "The server had an error while streaming the response.").body())
    finally:
        for generation, _ in choices:
            await generation.aclose()
    yield _event(DONE)


async def _merge(
    iterators: list[AsyncIterator[TextPiece]],
) -> AsyncGenerator[tuple[int, TextPiece], None]:
    """Pieces of several choices as they come, tagged with the choice index."""
    if len(iterators) == 1:  # the common case needs no tasks
        async for piece in iterators[0]:
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, TextPiece | None, Exception | None]] = asyncio.Queue()

    async def pump(index: int, iterator: AsyncIterator[TextPiece]) -> None:
        try:
            async for piece in iterator:
                queue.put_nowait((index, piece, None))
            queue.put_nowait((index, None, None))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, piece, exc = await queue.get()
            if exc is not None:
                raise exc
            if piece is None:
                remaining -= 1
            else:
                yield index, piece
    finally:
        for task in tasks:
            task.cancel()


def sse_response(
    choices: list[tuple[Pieces, ChunkFactory]], include_usage: bool, per_prompt: int | None = None
) -> ServerSentEvent:
    """A ``text/event-stream`` response streaming each choice's pieces through its chunk factory
    (``per_prompt``: choices per prompt of a batch, for the usage; see ``merge_usage``)."""
    events = _events(choices, include_usage, per_prompt)
    return ClosingServerSentEvent(events, close=events.aclose)


class ClosingServerSentEvent(ServerSentEvent):
    """A ``ServerSentEvent`` that runs ``close`` once its ASGI response has finished, also when
    the client went away mid-stream."""

    def __init__(self, content: Any, close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content)
        self._close = close

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        response = super().to_asgi_response(*args, **kwargs)
        close = self._close

        async def respond(scope: Any, receive: Any, send: Any) -> None:
            try:
                await response(scope, receive, send)
            finally:
                await close()

        return respond
