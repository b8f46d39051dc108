"""OpenAI Responses API bodies (the subset agents use) as msgspec Structs.

Requests forbid unknown fields, as the chat ones do. ``input`` items share one struct whose
``type`` says which fields it needs (``api.responses.items`` checks them): msgspec can only tell
union members apart by a tag, and a plain message item (``{"role", "content"}``) has none.
Responses, their output items and the streamed events are tagged by ``type``, as OpenAI's are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from jax_llm_runtime.api.protocol.bodies import (
    MAX_IMAGE_URL_CHARS,
    MAX_MESSAGES,
    MAX_TOOLS,
    NonNegFloat,
    PositiveInt,
    TopP,
)

FunctionName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]

# ----------------------------------------------------------------------------------------- requests


class InputContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A part of a message: ``input_text`` (what the client says), ``output_text`` (an earlier
    assistant message sent back; its ``annotations`` and ``logprobs`` are accepted and unused),
    or ``input_image`` with an ``image_url`` (as a chat ``image_url`` part's url: a vision-
    language model's image; ``detail`` is accepted and has no effect)."""

    type: Literal["input_text", "output_text", "input_image"]
    text: str | None = None
    image_url: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_IMAGE_URL_CHARS)] | None = (
        None
    )
    detail: Literal["auto", "low", "high"] | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    def __post_init__(self) -> None:
        if self.type == "input_image":
            if self.image_url is None or self.text is not None:
                raise ValueError("an input_image part takes an image_url (and no text)")
        elif self.text is None or self.image_url is not None:
            raise ValueError(f"an {self.type} part takes text (and no image_url)")


class InputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One ``input`` item; by ``type``:

    - ``message`` (the default): ``role`` and ``content`` (a string or text parts);
    - ``function_call``: an earlier call, ``call_id``, ``name`` and ``arguments``;
    - ``function_call_output``: the client's result of a call, ``call_id`` and ``output``;
    - ``mcp_call``: an MCP call this server ran, sent back: ``server_label``, ``name``,
      ``arguments`` and ``output`` (or ``error``).

    ``id`` and ``status`` of items sent back are accepted and unused.
    """

    type: Literal["message", "function_call", "function_call_output", "mcp_call"] = "message"
    id: str | None = None
    status: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContentPart] | None = None
    call_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None
    server_label: str | None = None
    error: Any = None


class FunctionToolParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A client-defined function: ``{"type": "function", "name", "description", "parameters"}``."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, forbid_unknown_fields=True):
    """``{"type": "function", "name": ...}``: the model must call this function."""

    type: Literal["function"]
    name: FunctionName


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/responses. ``tools`` absent: the server's MCP tools (if any); ``[]``: none.
    ``max_output_tokens`` bounds all the response's rounds together. ``store: false`` keeps the
    response out of the store that ``previous_response_id`` reads."""

    input: str | Annotated[list[InputItem], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    model: str | None = None
    instructions: str | None = None
    tools: Annotated[list[FunctionToolParam], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: NonNegFloat | None = None
    top_p: TopP | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: Annotated[dict[str, str], msgspec.Meta(max_length=16)] | None = None
    user: str | None = None


# ---------------------------------------------------------------------------------------- responses


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str  # in_progress, completed, incomplete
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call"):
    """A call of a client-defined function, for the client to run."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class McpCallItem(msgspec.Struct, tag_field="type", tag="mcp_call"):
    """An MCP tool call the server ran: ``name`` as the server knows it, ``server_label`` the
    server; ``output`` its result, or ``error`` (an ``mcp_protocol_error`` or
    ``mcp_tool_execution_error`` object) and status ``failed``."""

    id: str
    server_label: str
    name: str
    arguments: str
    status: str  # in_progress, completed, failed
    output: str | None = None
    error: dict[str, Any] | None = None


OutputItem = OutputMessage | FunctionCallItem | McpCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    """All the response's rounds together: each round's prompt counts as input."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str  # max_output_tokens


class ResponseObject(msgspec.Struct):
    """The ``response`` object; ``output_text`` joins the text of its messages."""

    id: str
    created_at: int
    model: str
    status: str  # in_progress, completed, incomplete
    output: list[OutputItem]
    output_text: str
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    store: bool
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    object: str = "response"


# ------------------------------------------------------------------------------------------- events


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int = 0  # set by the stream as events go out


class ResponseCreated(_Event, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(_Event, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: ResponseObject


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str
    name: str


class McpCallArgumentsDelta(_Event, tag="response.mcp_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class McpCallArgumentsDone(_Event, tag="response.mcp_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


class McpCallInProgress(_Event, tag="response.mcp_call.in_progress"):
    item_id: str
    output_index: int


class McpCallCompleted(_Event, tag="response.mcp_call.completed"):
    item_id: str
    output_index: int


class McpCallFailed(_Event, tag="response.mcp_call.failed"):
    item_id: str
    output_index: int


class ErrorEvent(_Event, tag="error"):
    """An error after the stream began (the status is already 200): the envelope's fields."""

    message: str
    code: str | None = None
    param: str | None = None


ResponseEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | McpCallArgumentsDelta
    | McpCallArgumentsDone
    | McpCallInProgress
    | McpCallCompleted
    | McpCallFailed
    | ErrorEvent
)
