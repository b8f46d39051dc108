"""A chat request from its checked body to its choices' pieces, shared by the chat completions
route and the Responses API (which runs one chat round per model turn).

``start_chat`` resolves the grammar (``response_format``, or a forced tool call), fills the
server's sampling defaults, renders and tokenizes the prompt, resolves the completion budget and
submits the request; each choice comes back as pieces with reasoning split off and, when the
request has tools, tool calls read out of the text. Errors are ``APIError``s naming the chat
fields (``messages``, ``max_tokens``, ``tools``, ``tool_choice``, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from litestar import Request

from jax_llm_runtime.api.generation.prompts import chat_prompt
from jax_llm_runtime.api.generation.reasoning import split_reasoning
from jax_llm_runtime.api.generation.stream import start_generation
from jax_llm_runtime.api.generation.structured import response_format_grammar
from jax_llm_runtime.api.protocol.bodies import ChatCompletionRequest
from jax_llm_runtime.api.protocol.defaults import completion_budget, with_sampling_defaults
from jax_llm_runtime.api.protocol.errors import bad_request
from jax_llm_runtime.api.protocol.validation import (
    build_sampling,
    check_top_logprobs,
    resolve_max_tokens,
    resolve_n,
)
from jax_llm_runtime.api.service.metrics import Metrics
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.api.tool_calling.chat import ToolCallPieces, ToolRequest
from jax_llm_runtime.runtime.engine.interface import EngineClient
from jax_llm_runtime.runtime.engine.request import SamplingParams
from jax_llm_runtime.runtime.text.tokenizer import SPECIAL_TOKEN_MARKERS


@dataclass(frozen=True)
class ChatStart:
    """A submitted chat request: its choices' pieces (``pieces()``, ``collect()``, ``aclose()``),
    its tools (None without any) and the sampling it runs with."""

    choices: list[Any]
    tools: ToolRequest | None
    sampling: SamplingParams
    n: int


async def start_chat(
    request: Request[Any, Any, Any],
    engine: EngineClient,
    config: ServerConfig,
    metrics: Metrics,
    body: ChatCompletionRequest,
    request_id: str,
) -> ChatStart:
    """Submit ``body`` (already decoded, its model checked) and wait for its first deltas."""
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
    processor = getattr(engine, "image_processor", None)
    prompt = await chat_prompt(engine.tokenizer, body, tools, processor, config.media)
    prompt_ids = prompt.ids
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = resolve_max_tokens(
        completion_budget(requested, len(prompt_ids), engine.max_model_len, config, None),
        len(prompt_ids),
        engine.max_model_len,
    )
    sampling = dataclasses.replace(build_sampling(body, max_tokens), grammar=grammar)
    special = getattr(engine.tokenizer, "reasoning_markers", None) in SPECIAL_TOKEN_MARKERS
    if tools is not None or special:  # markers may be special tokens: the parsers must see them
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    n = resolve_n(body.n, config.max_n)
    check_top_logprobs(sampling.logprobs, config.max_top_logprobs, "top_logprobs")
    generations = await start_generation(
        engine, request, prompt_ids, sampling, request_id, metrics, n, images=prompt.images
    )
    choices: list[Any] = [split_reasoning(engine.tokenizer, prompt_ids, g) for g in generations]
    if tools is not None:
        forced = tools.choice != "auto"
        choices = [ToolCallPieces(choice, tools.parser, forced) for choice in choices]
    return ChatStart(choices, tools, sampling, n)
