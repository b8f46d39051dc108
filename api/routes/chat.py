"""POST /v1/chat/completions: chat template, generation, JSON or SSE response."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, post

from api.dependencies import EngineDep
from api.disconnect import cancel_on_disconnect
from api.generation import start_generation
from api.prompts import chat_prompt_ids
from api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Usage,
)
from api.streaming import sse_response
from api.validation import (
    build_sampling,
    check_model,
    check_supported,
    decode_body,
    resolve_max_tokens,
)


@dataclass(frozen=True)
class ChatChunks:
    """``chat.completion.chunk`` objects for one streamed response."""

    id: str
    created: int
    model: str

    def _chunk(self, delta: ChatDelta, finish_reason: str | None = None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(self.id, self.created, self.model, [choice])

    def opening(self) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(role="assistant", content=""))

    def text(self, text: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(content=text))

    def finish(self, finish_reason: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(), finish_reason)

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, [], usage)


@post("/v1/chat/completions", status_code=200)
async def create_chat_completion(
    request: Request[Any, Any, Any], engine: EngineDep
) -> Response[Any]:
    """OpenAI chat completions; see ``ChatCompletionRequest`` for the accepted fields.

    Errors are OpenAI envelopes: 400 for bad or unsupported fields and prompts that do not fit the
    context, 404 for another model name, 503 when the engine shuts down mid-request.
    """
    body = decode_body(await request.body(), ChatCompletionRequest)
    check_model(body.model, engine.model_name)
    check_supported(body)
    prompt_ids = await chat_prompt_ids(engine.tokenizer, body)
    max_tokens = resolve_max_tokens(
        body.max_completion_tokens or body.max_tokens,
        len(prompt_ids),
        engine.max_model_len,
        "messages",
    )
    sampling = build_sampling(body, max_tokens)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    generation = await start_generation(
        engine, request, prompt_ids, sampling, request_id, body.stop_strings()
    )
    if body.stream:
        chunks = ChatChunks(request_id, created, engine.model_name)
        return sse_response(generation, chunks, body.wants_usage_chunk())
    result = await cancel_on_disconnect(request, generation.collect())
    choice = ChatChoice(0, AssistantMessage(result.text), result.finish_reason)
    return Response(ChatCompletion(request_id, created, engine.model_name, [choice], result.usage))
