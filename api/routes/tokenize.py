"""POST /tokenize and POST /detokenize (vLLM's shapes): the served model's tokenizer over HTTP.

``/tokenize`` takes ``{"prompt": str}`` (special tokens such as BOS added, as /v1/completions
does) or ``{"messages": [...]}`` (the chat template rendered, with the generation prompt unless
``add_generation_prompt`` is false, as /v1/chat/completions does), so the count is the one a
completion request would use. ``/detokenize`` turns ids back into text; ids outside the
vocabulary are a 400.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from litestar import Request, post

from jax_llm_runtime.api.generation.prompts import template_kwargs
from jax_llm_runtime.api.protocol.bodies import Messages, TokenId
from jax_llm_runtime.api.protocol.errors import bad_request
from jax_llm_runtime.api.protocol.openapi import documented
from jax_llm_runtime.api.protocol.validation import decode_body
from jax_llm_runtime.api.service.dependencies import EngineDep, ModelsDep
from jax_llm_runtime.api.service.disconnect import read_body


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of ``prompt`` and ``messages``. ``add_special_tokens`` defaults to true for a
    prompt and false for messages (the template supplies them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[TokenId]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def _render(engine: EngineDep, body: TokenizeRequest) -> str:
    """The text to encode: the prompt, or the rendered chat."""
    if body.messages is None:
        return body.prompt or ""
    kwargs = template_kwargs(body.chat_template_kwargs)
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    try:
        return engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, **kwargs
        )
    except ValueError as exc:
        raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from None


@post("/tokenize", status_code=200, operation_class=documented(TokenizeRequest))
async def tokenize(request: Request[Any, Any, Any], models: ModelsDep) -> TokenizeResponse:
    """Token ids of a prompt or a chat; 400 unless exactly one of them is given."""
    body = decode_body(await read_body(request), TokenizeRequest)
    engine = models.resolve(body.model).engine
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of `prompt` and `messages`.", param="prompt")
    add_special = body.add_special_tokens
    if add_special is None:
        add_special = body.messages is None

    def encode() -> list[int]:
        return engine.tokenizer.encode(_render(engine, body), add_special_tokens=add_special)

    try:
        tokens = await asyncio.to_thread(encode)
    except ValueError as exc:
        raise bad_request(f"Could not tokenize the prompt: {exc}", param="prompt") from None
    return TokenizeResponse(tokens, len(tokens), engine.max_model_len)


@post("/detokenize", status_code=200, operation_class=documented(DetokenizeRequest))
async def detokenize(request: Request[Any, Any, Any], models: ModelsDep) -> DetokenizeResponse:
    """The text of token ids (special tokens kept, so a round trip is faithful)."""
    body = decode_body(await read_body(request), DetokenizeRequest)
    engine = models.resolve(body.model).engine
    try:
        text = await asyncio.to_thread(
            engine.tokenizer.decode, body.tokens, skip_special_tokens=False
        )
    except ValueError as exc:
        raise bad_request(str(exc), param="tokens", code="invalid_token_id") from None
    return DetokenizeResponse(text)
