"""Request prompts to token ids: chat templates for /v1/chat/completions, text or ids for /v1/completions.

Rendering and tokenizing run in a worker thread (``asyncio.to_thread``) so a long prompt or a slow
template never stalls the event loop that streams other requests' tokens. Template and tokenizer
``ValueError``s (``ChatTemplateError`` is one) are 400s naming the prompt field.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from jax_llm_runtime.api.generation.media import request_images
from jax_llm_runtime.api.protocol.bodies import (
    MAX_BATCH_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TextContentPart,
)
from jax_llm_runtime.api.protocol.errors import bad_request
from jax_llm_runtime.api.service.settings import MediaConfig
from jax_llm_runtime.api.tool_calling.chat import ToolRequest, template_message_tool_calls
from jax_llm_runtime.runtime.engine.interface import TokenizerLike
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput
from jax_llm_runtime.runtime.multimodal.processor import ImageProcessor

# The template variables a request may set through ``chat_template_kwargs``: the switches that
# model families' templates read (Qwen3's enable_thinking, DeepSeek's thinking, gpt-oss'
# reasoning_effort, Llama 3's date_string, SmolLM3's custom_instructions). Everything else a
# template sees comes from the server, and the values are scalars, so a request cannot feed a
# template objects to walk or huge strings to multiply.
ALLOWED_TEMPLATE_KWARGS = frozenset(
    {"enable_thinking", "thinking", "reasoning_effort", "date_string", "custom_instructions"}
)
MAX_TEMPLATE_KWARG_CHARS = 4096


def template_kwargs(requested: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of a request's ``chat_template_kwargs`` after the allow-list; else a 400."""
    kwargs = dict(requested or {})
    refused = sorted(set(kwargs) - ALLOWED_TEMPLATE_KWARGS)
    if refused:
        raise bad_request(
            f"chat_template_kwargs may only set {', '.join(sorted(ALLOWED_TEMPLATE_KWARGS))}; "
            f"got {', '.join(refused)}",
            param="chat_template_kwargs",
        )
    for name, value in kwargs.items():
        if value is not None and not isinstance(value, (str, bool, int, float)):
            raise bad_request(
                f"chat_template_kwargs.{name} must be a string, number, boolean or null",
                param="chat_template_kwargs",
            )
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_KWARG_CHARS:
            raise bad_request(
                f"chat_template_kwargs.{name} is longer than {MAX_TEMPLATE_KWARG_CHARS} characters",
                param="chat_template_kwargs",
            )
    return kwargs


def _template_content(message: ChatMessage) -> str | list[dict[str, str]]:
    """A message's content as the template reads it: a string, or with images the list of
    parts that HF's processors hand templates (``{"type": "image"}`` where each image goes)."""
    if not message.image_urls():
        return message.text()
    assert isinstance(message.content, list)
    return [
        {"type": "text", "text": part.text}
        if isinstance(part, TextContentPart)
        else {"type": "image"}
        for part in message.content
    ]


def _template_message(message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": _template_content(message)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = template_message_tool_calls(message.tool_calls)
    return out


@dataclass(frozen=True)
class ChatPrompt:
    """A chat's prompt token ids (image placeholders expanded) and its images, in order."""

    ids: list[int]
    images: tuple[ImageInput, ...] = ()


async def chat_prompt(
    tokenizer: TokenizerLike,
    body: ChatCompletionRequest,
    tools: ToolRequest | None = None,
    processor: ImageProcessor | None = None,
    media: MediaConfig | None = None,
) -> ChatPrompt:
    """``chat_prompt_ids``, with the messages' images (``processor``: the model's, None when
    it takes none) loaded under ``media`` and their placeholders expanded as the model's HF
    processor expands them, so the ids hold every image token (``usage.prompt_tokens``
    counts them)."""
    images = await request_images(body.messages, processor, media or MediaConfig())
    ids = await chat_prompt_ids(tokenizer, body, tools, None if not images else (processor, images))
    return ChatPrompt(ids, images)


async def chat_prompt_ids(
    tokenizer: TokenizerLike,
    body: ChatCompletionRequest,
    tools: ToolRequest | None = None,
    expand: tuple[ImageProcessor, tuple[ImageInput, ...]] | None = None,
) -> list[int]:
    """Render the chat template (with the generation prompt) and encode it without BOS/EOS added.

    The template itself supplies the special tokens, so ``add_special_tokens=False`` avoids a
    doubled BOS. ``tools`` reach the template as its ``tools`` variable, or as a system message
    when it has none (``api.tool_calling.chat``). ``expand`` = (processor, images): the
    rendered text's image placeholders are expanded for those images first.
    """
    kwargs = template_kwargs(body.chat_template_kwargs)
    if tools is not None:
        kwargs.update(tools.template_kwargs())
    for field in ("enable_thinking", "thinking"):
        value = getattr(body, field)
        if value is None:
            continue
        if kwargs.setdefault("enable_thinking", value) != value:
            raise bad_request(
                f"`{field}` contradicts another enable_thinking setting in this request.",
                param=field,
            )
    for index, message in enumerate(body.messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise bad_request(
                "content is required, except in an assistant message with tool_calls",
                param=f"messages[{index}].content",
            )
    messages = [_template_message(m) for m in body.messages]
    if tools is not None:
        messages = tools.template_messages(messages)

    def render_and_encode() -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        if expand is not None:
            text = expand[0].expand(text, expand[1])
        return tokenizer.encode(text, add_special_tokens=False)

    try:
        return await asyncio.to_thread(render_and_encode)
    except ValueError as exc:
        raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from None


async def check_token_ids(
    tokenizer: TokenizerLike, token_ids: list[int], param: str, code: str
) -> None:
    """400 (``code``, naming ``param``) for ids outside the tokenizer's vocabulary.

    ``decode`` raises ValueError for such ids (``runtime.text.tokenizer.Tokenizer.decode``), so it is
    the check; the engine would otherwise read past its embedding table, or fail to pack an id
    past int32 and stop serving everyone.
    """
    try:
        await asyncio.to_thread(tokenizer.decode, token_ids, skip_special_tokens=False)
    except ValueError as exc:
        raise bad_request(f"Invalid token id in `{param}`: {exc}", param=param, code=code) from None


async def completion_prompts(
    tokenizer: TokenizerLike, body: CompletionRequest
) -> list[tuple[list[int], str | None]]:
    """Each prompt of the request as token ids, with its text (None for token ids).

    ``prompt`` is one text (encoded with special tokens, BOS included), one list of token ids
    (used as they are, once checked against the vocabulary), or a batch of either: a list of
    texts or a list of token id lists, at most ``MAX_BATCH_PROMPTS``. Anything else is a 400.
    """
    prompt = body.prompt
    if isinstance(prompt, str):
        batch: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        batch = [list(prompt)]  # type: ignore[arg-type]
    elif prompt and (
        all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)
    ):
        batch = list(prompt)  # type: ignore[arg-type]
    else:
        raise bad_request(
            "`prompt` must be a string, a list of token ids, a list of strings or a list of "
            "token id lists.",
            param="prompt",
        )
    if len(batch) > MAX_BATCH_PROMPTS:
        raise bad_request(
            f"`prompt` holds {len(batch)} prompts; at most {MAX_BATCH_PROMPTS} per request.",
            param="prompt",
        )
    return [(await _one_prompt_ids(tokenizer, p), p if isinstance(p, str) else None) for p in batch]


async def _one_prompt_ids(tokenizer: TokenizerLike, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("`prompt` must not hold an empty list of token ids.", param="prompt")
        if any(p < 0 for p in prompt):
            raise bad_request("Token ids in `prompt` must be >= 0.", param="prompt")
        await check_token_ids(tokenizer, prompt, "prompt", "invalid_prompt")
        return prompt
    if not prompt:
        raise bad_request("`prompt` must not be empty.", param="prompt")
    try:
        return await asyncio.to_thread(tokenizer.encode, prompt, add_special_tokens=True)
    except ValueError as exc:
        raise bad_request(f"Could not tokenize the prompt: {exc}", param="prompt") from None
