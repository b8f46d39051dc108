"""POST /v1/completions: raw text (or token id) prompts, JSON or SSE response."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, post

from jax_llm_runtime.api.generation.logprobs import (
    completion_logprobs,
    concat_logprobs,
    echo_logprobs,
)
from jax_llm_runtime.api.generation.prompts import completion_prompts
from jax_llm_runtime.api.generation.sse import sse_response
from jax_llm_runtime.api.generation.stream import (
    Generation,
    TextPiece,
    collect_all,
    merge_usage,
    start_generation,
)
from jax_llm_runtime.api.protocol.bodies import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Usage,
)
from jax_llm_runtime.api.protocol.defaults import completion_budget, with_sampling_defaults
from jax_llm_runtime.api.protocol.errors import APIError, bad_request
from jax_llm_runtime.api.protocol.openapi import documented
from jax_llm_runtime.api.protocol.validation import (
    build_sampling,
    check_supported,
    check_top_logprobs,
    decode_body,
    resolve_max_tokens,
    resolve_n,
)
from jax_llm_runtime.api.service.dependencies import ModelsDep
from jax_llm_runtime.api.service.disconnect import cancel_on_disconnect, read_body
from jax_llm_runtime.api.service.metrics import Metrics
from jax_llm_runtime.runtime.engine.interface import EngineClient, TokenizerLike
from jax_llm_runtime.runtime.engine.request import SamplingParams, TokenLogprobs

# OpenAI's legacy completions default, unlike chat, which may use the whole remaining context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass
class CompletionChunks:
    """Streamed ``text_completion`` objects for one response."""

    id: str
    created: int
    model: str
    tokenizer: TokenizerLike | None = None  # set when the request asked for logprobs
    text_offset: int = 0  # characters sent so far, for the logprobs' text_offset
    index: int = 0  # the choice (n > 1)
    echo: Echo | None = None  # the prompt, sent first, when the request has ``echo``

    def _chunk(
        self, text: str, finish_reason: str | None = None, logprobs: tuple[TokenLogprobs, ...] = ()
    ) -> Completion:
        choice = CompletionChoice(index=self.index, text=text, finish_reason=finish_reason)
        if self.tokenizer is not None:
            choice.logprobs = completion_logprobs(self.tokenizer, logprobs, self.text_offset)
            self.text_offset += len(text)
        return Completion(self.id, self.created, self.model, [choice])

    def opening(self) -> Completion | None:
        if self.echo is None:
            return None
        choice = CompletionChoice(index=self.index, text=self.echo.text, finish_reason=None)
        choice.logprobs = self.echo.logprobs
        self.text_offset = self.echo.offset
        return Completion(self.id, self.created, self.model, [choice])

    def text(self, text: str, logprobs: tuple[TokenLogprobs, ...] = ()) -> Completion:
        return self._chunk(text, logprobs=logprobs)

    def finish(self, finish_reason: str) -> Completion:
        return self._chunk("", finish_reason)

    def usage(self, usage: Usage) -> Completion:
        return Completion(self.id, self.created, self.model, [], usage)


@dataclass(frozen=True)
class Echo:
    """The prompt as a completion echoes it: its text and, with logprobs, its tokens' scores."""

    text: str
    logprobs: CompletionLogprobs | None

    @property
    def offset(self) -> int:
        """Where the completion's ``text_offset``s start: as in vLLM, offsets run over the token
        texts (an echoed BOS counts), continuing from the prompt's tokens into the completion's."""
        if self.logprobs is None or not self.logprobs.tokens:
            return len(self.text)
        return self.logprobs.text_offset[-1] + len(self.logprobs.tokens[-1])


async def _echo(
    engine: EngineClient,
    body: CompletionRequest,
    prompt_ids: list[int],
    text: str | None,
    logprobs: int | None,
) -> Echo | None:
    if not body.echo:
        return None
    if text is None:  # token ids: show what they decode to
        text = engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    if logprobs is None:
        return Echo(text, None)
    if not engine.healthy():  # scoring the prompt needs the engine loop
        raise APIError(503, "The engine is not running.", code="engine_unhealthy")
    try:
        scored = await engine.prompt_logprobs(prompt_ids, logprobs)
    except ValueError as exc:
        raise bad_request(str(exc), param="echo") from None
    return Echo(text, echo_logprobs(engine.tokenizer, prompt_ids, scored))


@dataclass
class _Prompt:
    """One prompt of the request, ready to submit: its ids, text (None: given as ids) and
    sampling."""

    ids: list[int]
    text: str | None
    sampling: SamplingParams


def _prepare(
    served: Any, body: CompletionRequest, prompts: list[tuple[list[int], str | None]]
) -> list[_Prompt]:
    """Every prompt's sampling (its own budget), before anything is submitted."""
    engine, config = served.engine, served.config
    out = []
    for ids, text in prompts:
        requested = completion_budget(
            body.max_tokens, len(ids), engine.max_model_len, config, DEFAULT_COMPLETION_MAX_TOKENS
        )
        sampling = build_sampling(
            body, resolve_max_tokens(requested, len(ids), engine.max_model_len)
        )
        check_top_logprobs(sampling.logprobs, config.max_top_logprobs, "logprobs")
        out.append(_Prompt(ids, text, sampling))
    return out


async def _echoes(
    engine: EngineClient, body: CompletionRequest, prompts: list[_Prompt], started: list[Generation]
) -> list[Echo | None]:
    """Each prompt's echo, scored once the engine has accepted every prompt; when one cannot be
    scored, the started generations are closed before its error goes out."""
    try:
        return [await _echo(engine, body, p.ids, p.text, p.sampling.logprobs) for p in prompts]
    except BaseException:
        for generation in started:
            await generation.aclose()
        raise


async def _start_all(
    engine: EngineClient,
    request: Request[Any, Any, Any],
    prompts: list[_Prompt],
    request_id: str,
    metrics: Metrics,
    n: int,
) -> list[Generation]:
    """``n`` generations per prompt, in choice order, all prompts submitted at once; when one
    cannot start, the others are closed (their sequences aborted) before its error goes out."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-p{i}" for i in range(len(prompts))]
    results = await asyncio.gather(
        *(
            start_generation(engine, request, p.ids, p.sampling, rid, metrics, n, "prompt")
            for p, rid in zip(prompts, ids, strict=True)
        ),
        return_exceptions=True,
    )
    started = [g for r in results if not isinstance(r, BaseException) for g in r]
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        for generation in started:
            await generation.aclose()
        raise failure
    return started


@post(
    "/v1/completions",
    status_code=200,
    operation_class=documented(CompletionRequest, Completion, Completion),
)
async def create_completion(
    request: Request[Any, Any, Any], models: ModelsDep, metrics: Metrics
) -> Response[Any]:
    """OpenAI (legacy) completions; see ``CompletionRequest`` for the accepted fields.

    ``max_tokens`` defaults to 16 as in OpenAI's API, capped by what the context leaves. A batch
    of prompts gets ``n`` choices per prompt: choice ``i * n + j`` is prompt ``i``'s ``j``-th.
    """
    body = decode_body(await read_body(request), CompletionRequest)
    served = models.resolve(body.model)
    engine = served.engine
    check_supported(body)
    body = with_sampling_defaults(body, served.config.sampling_defaults)
    n = resolve_n(body.n, served.config.max_n)
    prompts = _prepare(served, body, await completion_prompts(engine.tokenizer, body))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    generations = await _start_all(engine, request, prompts, request_id, metrics, n)
    echoes = [e for e in await _echoes(engine, body, prompts, generations) for _ in range(n)]
    tokenizer = engine.tokenizer if prompts[0].sampling.logprobs is not None else None
    if body.stream:
        factories = [
            CompletionChunks(request_id, created, engine.model_name, tokenizer, index=i, echo=echo)
            for i, echo in enumerate(echoes)
        ]
        return sse_response(
            list(zip(generations, factories, strict=True)), body.wants_usage_chunk(), n
        )
    results = await cancel_on_disconnect(request, collect_all(generations))
    choices = [
        _choice(index, result, echo, tokenizer)
        for index, (result, echo) in enumerate(zip(results, echoes, strict=True))
    ]
    usage = merge_usage([r.usage for r in results], n)
    return Response(Completion(request_id, created, engine.model_name, choices, usage))


def _choice(
    index: int, result: TextPiece, echo: Echo | None, tokenizer: TokenizerLike | None
) -> CompletionChoice:
    """One choice of a whole (not streamed) completion, its echoed prompt first."""
    prefix = echo.text if echo is not None else ""
    offset = echo.offset if echo is not None else 0
    choice = CompletionChoice(index, prefix + result.text, result.finish_reason)
    if tokenizer is not None:
        choice.logprobs = completion_logprobs(tokenizer, result.logprobs, offset)
        if echo is not None and echo.logprobs is not None:
            choice.logprobs = concat_logprobs(echo.logprobs, choice.logprobs)
    return choice
