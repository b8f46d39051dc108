"""POST /v1/completions: raw text (or token id) prompts, JSON or SSE response."""

from __future__ import annotations

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
from jax_llm_runtime.api.generation.prompts import completion_prompt_ids
from jax_llm_runtime.api.generation.sse import sse_response
from jax_llm_runtime.api.generation.stream import collect_all, merge_usage, start_generation
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
from jax_llm_runtime.api.service.disconnect import cancel_on_disconnect
from jax_llm_runtime.api.service.metrics import Metrics
from jax_llm_runtime.runtime.engine.interface import EngineClient, TokenizerLike
from jax_llm_runtime.runtime.engine.request import TokenLogprobs

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
    engine: EngineClient, body: CompletionRequest, prompt_ids: list[int], logprobs: int | None
) -> Echo | None:
    if not body.echo:
        return None
    prompt = body.prompt
    text = prompt if isinstance(prompt, str) else prompt[0] if isinstance(prompt[0], str) else None
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


@post(
    "/v1/completions",
    status_code=200,
    operation_class=documented(CompletionRequest, Completion, Completion),
)
async def create_completion(
    request: Request[Any, Any, Any], models: ModelsDep, metrics: Metrics
) -> Response[Any]:
    """OpenAI (legacy) completions; see ``CompletionRequest`` for the accepted fields.

    ``max_tokens`` defaults to 16 as in OpenAI's API, capped by what the context leaves.
    """
    body = decode_body(await request.body(), CompletionRequest)
    served = models.resolve(body.model)
    engine, config = served.engine, served.config
    check_supported(body)
    body = with_sampling_defaults(body, config.sampling_defaults)
    prompt_ids = await completion_prompt_ids(engine.tokenizer, body)
    requested = completion_budget(
        body.max_tokens,
        len(prompt_ids),
        engine.max_model_len,
        config,
        DEFAULT_COMPLETION_MAX_TOKENS,
    )
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), engine.max_model_len, "prompt")
    sampling = build_sampling(body, max_tokens)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n = resolve_n(body.n, config.max_n)
    check_top_logprobs(sampling.logprobs, config.max_top_logprobs, "logprobs")
    echo = await _echo(engine, body, prompt_ids, sampling.logprobs)
    generations = await start_generation(
        engine, request, prompt_ids, sampling, request_id, metrics, n
    )
    tokenizer = engine.tokenizer if sampling.logprobs is not None else None
    if body.stream:
        factories = [
            CompletionChunks(request_id, created, engine.model_name, tokenizer, index=i, echo=echo)
            for i in range(n)
        ]
        return sse_response(
            list(zip(generations, factories, strict=True)), body.wants_usage_chunk()
        )
    results = await cancel_on_disconnect(request, collect_all(generations))
    choices = []
    prefix = echo.text if echo is not None else ""
    offset = echo.offset if echo is not None else 0
    for index, result in enumerate(results):
        choice = CompletionChoice(index, prefix + result.text, result.finish_reason)
        if tokenizer is not None:
            choice.logprobs = completion_logprobs(tokenizer, result.logprobs, offset)
            if echo is not None and echo.logprobs is not None:
                choice.logprobs = concat_logprobs(echo.logprobs, choice.logprobs)
        choices.append(choice)
    usage = merge_usage([r.usage for r in results])
    return Response(Completion(request_id, created, engine.model_name, choices, usage))
