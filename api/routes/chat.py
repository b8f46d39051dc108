"""POST /v1/chat/completions: chat template, generation, JSON or SSE response."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response, post

from jax_llm_runtime.api.generation.chat_start import start_chat
from jax_llm_runtime.api.generation.logprobs import chat_logprobs
from jax_llm_runtime.api.generation.sse import sse_response
from jax_llm_runtime.api.generation.stream import collect_all, merge_usage
from jax_llm_runtime.api.mcp.client import McpClients
from jax_llm_runtime.api.protocol.bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Usage,
)
from jax_llm_runtime.api.protocol.openapi import documented
from jax_llm_runtime.api.protocol.validation import check_supported, decode_body
from jax_llm_runtime.api.service.dependencies import ModelsDep
from jax_llm_runtime.api.service.disconnect import cancel_on_disconnect, read_body
from jax_llm_runtime.api.service.metrics import Metrics
from jax_llm_runtime.runtime.engine.interface import TokenizerLike
from jax_llm_runtime.runtime.engine.request import TokenLogprobs


@dataclass(frozen=True)
class ChatChunks:
    """``chat.completion.chunk`` objects for one streamed response."""

    id: str
    created: int
    model: str
    tokenizer: TokenizerLike | None = None  # set when the request asked for logprobs
    index: int = 0  # the choice (n > 1)

    def _chunk(
        self,
        delta: ChatDelta,
        finish_reason: str | None = None,
        logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=self.index, delta=delta, finish_reason=finish_reason)
        if self.tokenizer is not None:
            choice.logprobs = chat_logprobs(self.tokenizer, logprobs)
        return ChatCompletionChunk(self.id, self.created, self.model, [choice])

    def opening(self) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(role="assistant", content=""))

    def text(self, text: str, logprobs: tuple[TokenLogprobs, ...] = ()) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(content=text), logprobs=logprobs)

    def reasoning(self, text: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(reasoning_content=text, reasoning=text))

    def tool_calls(self, calls: list[dict[str, Any]]) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(tool_calls=calls))

    def finish(self, finish_reason: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(), finish_reason)

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, [], usage)


@post(
    "/v1/chat/completions",
    status_code=200,
    operation_class=documented(ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
)
async def create_chat_completion(
    request: Request[Any, Any, Any],
    models: ModelsDep,
    metrics: Metrics,
    mcp: McpClients,
) -> Response[Any]:
    """OpenAI chat completions; see ``ChatCompletionRequest`` for the accepted fields.

    A request without ``tools`` gets the server's MCP tools (``--mcp-config``), which the client
    runs itself: the reply's ``tool_calls`` are returned, never executed here.

    Errors are OpenAI envelopes: 400 for bad or unsupported fields and prompts that do not fit the
    context, 404 for another model name, 503 when the engine shuts down mid-request.
    """
    body = decode_body(await read_body(request), ChatCompletionRequest)
    served = models.resolve(body.model)
    engine, config = served.engine, served.config
    check_supported(body)
    if body.tools is None and mcp.tools:  # the server's MCP tools; ``tools: []`` opts out
        body = msgspec.structs.replace(body, tools=mcp.openai_tools())
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    started = await start_chat(request, engine, config, metrics, body, request_id)
    choices, sampling, n = started.choices, started.sampling, started.n
    tokenizer = engine.tokenizer if sampling.logprobs is not None else None
    if body.stream:
        factories = [
            ChatChunks(request_id, created, engine.model_name, tokenizer, i) for i in range(n)
        ]
        return sse_response(list(zip(choices, factories, strict=True)), body.wants_usage_chunk())
    results = await cancel_on_disconnect(request, collect_all(choices))
    out = []
    for index, result in enumerate(results):
        message = AssistantMessage(result.text)
        if engine.tokenizer.reasoning_markers is not None:
            message.reasoning_content = message.reasoning = result.reasoning
        if result.tool_calls:
            message.tool_calls = list(result.tool_calls)
            message.content = result.text or None
        choice = ChatChoice(index, message, result.finish_reason)
        if tokenizer is not None:
            choice.logprobs = chat_logprobs(tokenizer, result.logprobs)
        out.append(choice)
    usage = merge_usage([r.usage for r in results])
    return Response(ChatCompletion(request_id, created, engine.model_name, out, usage))
