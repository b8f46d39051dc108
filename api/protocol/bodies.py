"""OpenAI request and response bodies as msgspec Structs.

Requests forbid unknown fields, so a typo is a 400 rather than a silently ignored setting. Fields that
OpenAI clients commonly send but this server cannot honour yet (tools,
...) are declared so ``api.protocol.validation`` can reject a non-default value with a
"not supported yet" message naming the field; their defaults are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from jax_llm_runtime.runtime.engine.request import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    PENALTY_WINDOW,
)

# What one request may hold. The body size cap (``ServerConfig.max_request_body_bytes``) bounds
# everything; these bound what costs work per generated token (every stop string is matched on
# every delta), what the engine packs into int32 arrays, and lists a client has no reason to make
# long. The declared limits are also the OpenAPI document's (``api.protocol.openapi``).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_MESSAGES = 2048
MAX_BATCH_PROMPTS = 128  # prompts in one /v1/completions batch
MAX_TOOLS = 128  # OpenAI's limit on functions per request
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]  # OpenAI's presence/frequency range
Bias = Annotated[float, msgspec.Meta(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]
BiasKey = Annotated[str, msgspec.Meta(pattern="^[0-9]+$")]  # a token id (JSON keys are strings)
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopList = Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)]


class TaggedStop(msgspec.Struct, forbid_unknown_fields=True):
    """candle-vllm's spelling of ``stop``: ``{"Single": "</s>"}`` or ``{"Multi": [...]}``."""

    Single: StopString | None = None
    Multi: StopList | None = None

    def __post_init__(self) -> None:
        if (self.Single is None) == (self.Multi is None):
            raise ValueError('stop as an object takes exactly one of "Single" or "Multi"')

    def strings(self) -> tuple[str, ...]:
        return (self.Single,) if self.Single is not None else tuple(self.Multi or ())


Stop = StopString | StopList | TaggedStop
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]

# ----------------------------------------------------------------------------------------- requests


class TextContentPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """``{"type": "text", "text": ...}``. Content parts are a tagged union (``ContentPart``), so
    ``type`` is required; part types other than text and images (audio, files) are a 400."""

    text: str


MAX_IMAGE_URL_CHARS = 64 * 2**20  # a data: URL; the request body cap bounds it first


class ImageURL(msgspec.Struct, forbid_unknown_fields=True):
    """``url``: a ``data:image/...;base64,`` URL, or an http(s) or file URL the server's media
    policy allows (``api.generation.media``). ``detail`` is accepted and has no effect: the
    model's processor fixes the resolution."""

    url: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_IMAGE_URL_CHARS)]
    detail: Literal["auto", "low", "high"] | None = None


class ImageContentPart(
    msgspec.Struct, tag_field="type", tag="image_url", forbid_unknown_fields=True
):
    """``{"type": "image_url", "image_url": {"url": ...}}``: an image for a vision-language
    model (a 400 for a model that takes none)."""

    image_url: ImageURL


ContentPart = TextContentPart | ImageContentPart


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(msgspec.Struct, forbid_unknown_fields=True):
    """A tool call of an earlier assistant turn, sent back in the history."""

    id: Annotated[str, msgspec.Meta(max_length=256)]
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn. ``developer`` is OpenAI's newer name for ``system`` and renders as it. An
    assistant turn that called tools carries ``tool_calls`` (its content may be null); the tool's
    answer comes back as a ``tool`` turn with the call's ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: Annotated[list[ToolCallParam], msgspec.Meta(max_length=MAX_TOOLS)] | None = None

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines (none: empty), image
        parts left out."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextContentPart))

    def image_urls(self) -> list[str]:
        """The URLs of the content's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImageContentPart)]


Messages = Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]


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
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    max_tokens: PositiveInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = (
        None
    )
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    # Accepted only at their defaults (see the module docstring).
    n: PositiveInt | None = None
    # runtime.engine.request.SamplingParams checks these too (a 400 naming the field).
    seed: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None  # mod 2**32
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[BiasKey, Bias], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] | None = (
        None
    )
    # vLLM / candle-vllm extensions.
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=PENALTY_WINDOW)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty when unset)."""
        if self.stop is None:
            return ()
        if isinstance(self.stop, TaggedStop):
            return self.stop.strings()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def wants_usage_chunk(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/chat/completions. ``max_completion_tokens`` wins over the older ``max_tokens``."""

    messages: Messages
    max_completion_tokens: PositiveInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Reasoning models: reach the chat template as its ``enable_thinking`` variable.
    enable_thinking: bool | None = None
    thinking: bool | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    # Accepted only at their defaults.
    response_format: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM.rs's context-cache id, which candle-vllm's examples/chat.py always sends (null unless
    # --context_cache): accepted and unused, the prefix cache reuses a conversation's K/V anyway.
    session_id: str | None = None


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/completions. ``prompt`` is text, token ids, or a batch: a list of texts or a list
    of token id lists (each prompt gets its own ``n`` choices, indexed prompt by prompt)."""

    prompt: str | list[str | int | list[int]]
    logprobs: TopLogprobs | None = None  # OpenAI allows 0..5
    # Accepted only at their defaults.
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# ---------------------------------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0  # completion tokens inside a reasoning block, when parsed


class Usage(msgspec.Struct):
    """OpenAI's usage, plus candle-vllm's ``prompt_time_costs`` (time to first token) and
    ``completion_time_costs`` (first token to finish), both in milliseconds."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = msgspec.field(
        default_factory=CompletionTokensDetails
    )
    prompt_time_costs: int = 0
    completion_time_costs: int = 0


class AssistantMessage(msgspec.Struct):
    """``reasoning_content`` (and ``reasoning``, vLLM's newer name for the same text) hold a
    reasoning model's thinking; both are left out for other models."""

    content: str | None
    role: str = "assistant"
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | msgspec.UnsetType = msgspec.UNSET
    # OpenAI's [{"id", "type": "function", "function": {"name", "arguments"}}]; left out when none
    tool_calls: list[dict[str, Any]] | msgspec.UnsetType = msgspec.UNSET


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    """One generated token in ``choices[i].logprobs.content``."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions format; ``text_offset`` runs over the token texts, which is the
    choice's text unless an echoed prompt holds special tokens (e.g. a BOS)."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


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
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's streamed delta.tool_calls items


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


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
    logprobs: CompletionLogprobs | None = None


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


class ErrorBody(msgspec.Struct, forbid_unknown_fields=True):
    """All four keys are always sent; ``param`` names the field at fault, when there is one."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, forbid_unknown_fields=True):
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


# ------------------------------------------------------------------------------------- embeddings

# A string, a list of strings, a list of token ids, or a list of lists of token ids; a mixed list
# is rejected by the route.
EmbeddingInput = str | list[str | TokenId | list[TokenId]]


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/embeddings. ``pooling`` ("mean" or "last") and ``normalize`` (L2, default true)
    are extensions; ``dimensions`` is accepted only unset."""

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["mean", "last"] = "mean"
    normalize: bool = True
    user: str | None = None
    dimensions: int | None = None


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"
