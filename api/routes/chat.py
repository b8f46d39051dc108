"""POST /v1/chat/completions: chat template, generation, JSON or SSE response."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, post

from api.config import ServerConfig
from api.defaults import completion_budget, with_sampling_defaults
from api.dependencies import EngineDep
from api.disconnect import cancel_on_disconnect
from api.errors import bad_request
from api.generation import collect_all, merge_usage, start_generation
from api.logprobs import chat_logprobs
from api.metrics import Metrics
from api.openapi import documented
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
from api.reasoning import split_reasoning
from api.streaming import sse_response
from api.structured import response_format_grammar
from api.tools import ToolCallPieces, ToolRequest
from api.validation import (
    build_sampling,
    check_model,
    check_supported,
    check_top_logprobs,
    decode_body,
    resolve_max_tokens,
    resolve_n,
)
from runtime.interface import TokenizerLike
from runtime.request import TokenLogprobs


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
    request: Request[Any, Any, Any], engine: EngineDep, config: ServerConfig, metrics: Metrics
) -> Response[Any]:
    """OpenAI chat completions; see ``ChatCompletionRequest`` for the accepted fields.

    Errors are OpenAI envelopes: 400 for bad or unsupported fields and prompts that do not fit the
    context, 404 for another model name, 503 when the engine shuts down mid-request.
    """
    body = decode_body(await request.body(), ChatCompletionRequest)
    check_model(body.model, config.model_names(engine.model_name))
    check_supported(body)
    grammar = response_format_grammar(body.response_format)  # a bad schema is a 400 here
    tools = ToolRequest.from_body(
        body, getattr(engine.tokenizer, "chat_template", None), config.tool_parser
    )
    if tools is not None and tools.choice != "auto":
        if grammar is not None:
            raise bad_request(
                "tool_choice 'required' or a named function cannot be combined with a "
                "response_format",
                param="tool_choice",
            )
        grammar = tools.grammar()
    body = with_sampling_defaults(body, config.sampling_defaults)
    prompt_ids = await chat_prompt_ids(engine.tokenizer, body, tools)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = resolve_max_tokens(
        completion_budget(requested, len(prompt_ids), engine.max_model_len, config, None),
        len(prompt_ids),
        engine.max_model_len,
        "messages",
    )
    sampling = dataclasses.replace(build_sampling(body, max_tokens), grammar=grammar)
    if tools is not None:  # call markers may be special tokens: the parser must see them
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n = resolve_n(body.n, config.max_n)
    check_top_logprobs(sampling.logprobs, config.max_top_logprobs, "top_logprobs")
    generations = await start_generation(
        engine, request, prompt_ids, sampling, request_id, body.stop_strings(), metrics, n
    )
    choices: list[Any] = [split_reasoning(engine.tokenizer, prompt_ids, g) for g in generations]
    if tools is not None:
        choices = [ToolCallPieces(choice, tools.parser) for choice in choices]
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
