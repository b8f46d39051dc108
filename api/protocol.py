"""OpenAI request and response bodies as msgspec Structs.

Requests forbid unknown fields, so a typo is a 400 rather than a silently ignored setting. Fields that
OpenAI clients commonly send but this server cannot honour yet (``n > 1``, ``seed``, penalties,
logprobs, tools, ...) are declared so ``api.validation`` can reject a non-default value with a
"not supported yet" message naming the field; their defaults are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
StopString = Annotated[str, msgspec.Meta(min_length=1)]
MAX_STOP_STRINGS = 16
Stop = StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)]

# ----------------------------------------------------------------------------------------- requests


class TextContentPart(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    """``{"type": "text", "text": ...}``; other part types (images, audio) are a 400."""

    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn. ``developer`` is OpenAI's newer name for ``system`` and renders as it."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart]
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``include_usage``: send a last chunk with ``usage`` (and no choices) before ``[DONE]``."""

    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by /v1/chat/completions and /v1/completions.

    ``top_k`` (-1 or 0 disable it), ``ignore_eos`` and ``stop_token_ids`` are vLLM extensions.
    """

    model: str | None = None
    temperature: NonNegFloat | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    max_tokens: PositiveInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    user: str | None = None
    # Accepted only at their defaults (see the module docstring).
    n: PositiveInt | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty when unset)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def wants_usage_chunk(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/chat/completions. ``max_completion_tokens`` wins over the older ``max_tokens``."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted only at their defaults.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/completions. ``prompt`` is text, token ids, or a list holding one text."""

    prompt: str | list[str | int]
    # Accepted only at their defaults.
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# ---------------------------------------------------------------------------------------- responses


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """A chunk's ``delta``: the first carries the role, the last is empty."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(msgspec.Struct):
    """A ``text_completion`` body; streamed chunks use the same shape with ``usage`` null."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    max_model_len: int
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody
