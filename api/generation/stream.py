"""One request's engine stream as text pieces: submission, collection, and closing.

1. ``start_generation`` submits the prompt and waits for the first delta, so a prompt the engine
   rejects (``ValueError``) is still a plain 400, before any streamed byte, and a client that leaves
   while its request is queued is noticed (``cancel_on_disconnect``).
2. ``Generation.pieces`` turns deltas into ``TextPiece``s with usage. The engine has applied the
   stop strings already (``SamplingParams.stop``), so a delta's text and logprobs go out as they are.
3. ``Generation.collect`` gathers a whole completion for non-streamed responses.
4. However iteration ends (finish, stop string, error, disconnect), the engine stream is closed,
   which aborts an unfinished sequence in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from litestar import Request

from jax_llm_runtime.api.generation.timing import RequestTiming
from jax_llm_runtime.api.protocol.bodies import CompletionTokensDetails, PromptTokensDetails, Usage
from jax_llm_runtime.api.protocol.errors import APIError, bad_request
from jax_llm_runtime.api.service.disconnect import cancel_on_disconnect
from jax_llm_runtime.api.service.metrics import Metrics
from jax_llm_runtime.runtime.engine.interface import EngineClient
from jax_llm_runtime.runtime.engine.request import (
    ContextLengthError,
    FinishReason,
    GenerationDelta,
    SamplingFieldError,
    SamplingParams,
    TokenLogprobs,
)
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput


@dataclass(frozen=True)
class TextPiece:
    """Text produced since the previous piece, and the request's token counts so far."""

    text: str
    finish_reason: str | None  # "stop" or "length" on the last piece
    usage: Usage
    reasoning: str = ""  # a reasoning model's thinking, split off by ``api.generation.reasoning``
    # The tokens whose text this piece completes, when the request asked (``api.generation.logprobs``).
    logprobs: tuple[TokenLogprobs, ...] = ()
    # Tool calls read from the text by ``api.tool_calling.chat``: streamed ``ToolCallDelta``s, or, in a
    # collected reply, OpenAI's ``message.tool_calls`` items.
    tool_calls: tuple[Any, ...] = ()


class EngineStreamError(RuntimeError):
    """The engine's stream ended without a finish reason (an engine bug)."""


def _usage(delta: GenerationDelta, timing: RequestTiming) -> Usage:
    return Usage(
        prompt_tokens=delta.num_prompt_tokens,
        completion_tokens=delta.num_output_tokens,
        total_tokens=delta.num_prompt_tokens + delta.num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=delta.num_cached_tokens),
        prompt_time_costs=timing.prompt_time_costs_ms,
        completion_time_costs=timing.completion_time_costs_ms,
    )


def _aborted() -> APIError:
    return APIError(
        503, "The request was aborted because the engine stopped.", code="engine_aborted"
    )


def _failed() -> APIError:
    return APIError(500, "The server had an error while processing the request.")


async def _close(deltas: AsyncIterator[GenerationDelta]) -> None:
    aclose = getattr(deltas, "aclose", None)
    if aclose is not None:
        await aclose()


class Generation:
    """A submitted request, positioned after its first delta. Iterate ``pieces`` once."""

    def __init__(
        self,
        deltas: AsyncIterator[GenerationDelta],
        first: GenerationDelta,
        timing: RequestTiming | None = None,
        metrics: Metrics | None = None,
        model_name: str = "",
    ) -> None:
        self._deltas = deltas
        self._first = first
        self._timing = timing or RequestTiming()
        self._metrics = metrics
        self._model_name = model_name  # the metrics' label
        self._last = first  # the latest delta read
        self._counted = False  # recorded as finished in the metrics

    def _finished(self, delta: GenerationDelta, finish_reason: str) -> Usage:
        """The final usage; records the request's latencies and tokens in the metrics."""
        self._counted = True
        self._timing.mark_finished()
        if self._metrics is not None:
            self._metrics.observe_finished(
                self._model_name,
                finish_reason,
                delta.num_prompt_tokens,
                delta.num_output_tokens,
                self._timing.ttft_s,
                self._timing.decode_s,
            )
        return _usage(delta, self._timing)

    async def aclose(self) -> None:
        """Close the engine stream (aborting the sequence if it is unfinished). Idempotent."""
        await _close(self._deltas)

    async def finish(self, reason: str) -> None:
        """End the reply here, as the layer above decided (a tool call repeated): the sequence
        is aborted, and the request counts as finished with ``reason`` and the tokens so far."""
        if not self._counted:
            self._finished(self._last, reason)
        await self.aclose()

    async def pieces(self) -> AsyncIterator[TextPiece]:
        """Yield text as it is generated; the last piece carries the finish reason.

        Raises APIError(503) when the engine aborted the request (shutdown), and
        EngineStreamError when the stream ends without a finish reason.
        """
        delta = self._first
        try:
            while True:
                if delta.finish_reason is FinishReason.ABORT:
                    raise _aborted()
                if delta.finish_reason is FinishReason.ERROR:
                    raise _failed()
                if delta.finish_reason is not None:
                    reason = delta.finish_reason.value
                    usage = self._finished(delta, reason)
                    yield TextPiece(delta.text, reason, usage, logprobs=delta.logprobs)
                    return
                if delta.text:
                    usage = _usage(delta, self._timing)
                    yield TextPiece(delta.text, None, usage, logprobs=delta.logprobs)
                delta = self._last = await self._next()
        finally:
            await self.aclose()

    async def _next(self) -> GenerationDelta:
        try:
            return await anext(self._deltas)
        except StopAsyncIteration:
            raise EngineStreamError("the engine stream ended without a finish reason") from None

    async def collect(self) -> TextPiece:
        """The whole completion as one piece (text, finish reason, final usage)."""
        parts: list[str] = []
        logprobs: list[TokenLogprobs] = []
        last: TextPiece | None = None
        async for piece in self.pieces():
            parts.append(piece.text)
            logprobs += piece.logprobs
            last = piece
        if last is None:  # pieces() always ends with a finish piece or raises
            raise EngineStreamError("the engine stream produced no output")
        return TextPiece("".join(parts), last.finish_reason, last.usage, logprobs=tuple(logprobs))


async def start_generation(
    engine: EngineClient,
    request: Request[Any, Any, Any],
    prompt_ids: list[int],
    sampling: SamplingParams,
    request_id: str,
    metrics: Metrics | None = None,
    n: int = 1,
    prompt_param: str = "messages",
    images: tuple[ImageInput, ...] = (),
) -> list[Generation]:
    """Submit ``n`` completions of the prompt and wait for the first delta of each.

    Raises APIError(400) when the engine rejects the submission (a prompt and budget beyond the
    context name ``prompt_param``, the request's field for the prompt), ClientDisconnectedError
    when the client leaves first (the engine requests are aborted), APIError(503) when the engine
    is not running or shuts down. ``images`` go to a vision-language model with the prompt.
    """
    if not engine.healthy():
        raise APIError(503, "The engine is not running.", code="engine_unhealthy")
    timing = RequestTiming()
    try:
        if images:  # engines that take no images never see the argument
            streams = engine.generate_n(prompt_ids, sampling, request_id, n, images)
        else:
            streams = engine.generate_n(prompt_ids, sampling, request_id, n)
    except ValueError as exc:
        raise _rejected(exc, prompt_param) from None

    async def first_deltas() -> list[GenerationDelta]:
        return list(await asyncio.gather(*(anext(s) for s in streams)))

    try:
        firsts = await cancel_on_disconnect(request, first_deltas())
    except BaseException as exc:
        for stream in streams:
            await _close(stream)
        if isinstance(exc, ValueError):
            raise _rejected(exc, prompt_param) from None
        if isinstance(exc, StopAsyncIteration):
            raise EngineStreamError("the engine stream ended before its first delta") from None
        raise
    timing.mark_first_token()
    return [
        Generation(stream, first, timing, metrics, engine.model_name)
        for stream, first in zip(streams, firsts, strict=True)
    ]


def _rejected(exc: ValueError, prompt_param: str) -> APIError:
    """The 400 for a submission the engine refused."""
    if isinstance(exc, ContextLengthError):  # names the prompt when it alone leaves no room
        return bad_request(
            exc.describe(prompt_param),
            param=prompt_param if exc.prompt_too_long else "max_tokens",
            code="context_length_exceeded",
        )
    if isinstance(exc, SamplingFieldError):
        return bad_request(str(exc), param=exc.param)
    return bad_request(str(exc), code="invalid_prompt")


async def collect_all(choices: list[Any]) -> list[TextPiece]:
    """Every choice's whole completion (each has ``collect()``), as one cancellable coroutine."""
    return list(await asyncio.gather(*(choice.collect() for choice in choices)))


def merge_usage(usages: list[Usage], per_prompt: int | None = None) -> Usage:
    """One usage for the completions of a response, in choice order: each run of ``per_prompt``
    choices (all of them when None: ``n`` completions of one prompt) shares one prompt, which
    counts once."""
    per_prompt = per_prompt or len(usages)
    firsts = usages[::per_prompt]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages)
    reasoning = sum(u.completion_tokens_details.reasoning_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in firsts)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning),
        prompt_time_costs=max(u.prompt_time_costs for u in firsts),
        completion_time_costs=max(u.completion_time_costs for u in usages),
    )
