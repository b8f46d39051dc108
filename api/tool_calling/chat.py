"""Tool calling on /v1/chat/completions: tools into the prompt, tool calls out of the reply.

1. ``ToolRequest.from_body`` checks ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (a 400
   naming the field) and picks the parser: ``--tool-parser``, else the one the chat template's
   markers name (``api.tool_calling.parsers.parser_for_template``). A template that does not render tools
   gets them in a system message that asks for the ``json`` format, which that parser reads.
2. ``tool_choice``: ``none`` leaves the tools out of the prompt and the reply unparsed; ``auto``
   lets the model answer or call; ``required`` and a named function are enforced by a grammar
   (``runtime.engine.grammar``) of the parser's own format around the tools' parameter schemas, so the
   model cannot answer without calling (one call for a named function or with
   ``parallel_tool_calls: false``, one or more otherwise).
3. ``ToolCallPieces`` runs the reply's text through the parser as it streams: content goes out
   without markup, each call as OpenAI's ``delta.tool_calls`` items (index, id and name first,
   then argument fragments). A reply with calls finishes with ``tool_calls``.
4. A call that repeats one the reply already made (same name, same arguments) ends the reply: it
   is never sent, the sequence is aborted (as a stop string aborts one), and the reply finishes
   with ``tool_calls`` (``api.tool_calling.repeats``). Small models otherwise repeat a call until
   ``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from jax_llm_runtime.api.generation.stream import TextPiece
from jax_llm_runtime.api.protocol.errors import bad_request
from jax_llm_runtime.api.tool_calling.parsers import (
    PARSERS,
    ContentDelta,
    ReasoningDelta,
    StreamEvent,
    ToolCallDelta,
    ToolParser,
    parser_for_template,
)
from jax_llm_runtime.api.tool_calling.repeats import RepeatGuard
from jax_llm_runtime.runtime.engine.grammar import GrammarError, lark_grammar
from jax_llm_runtime.runtime.engine.request import TokenLogprobs

# Formats with no grammar to force a call in (their arguments are not one JSON value).
_UNFORCED_PARSERS = frozenset(
    {"llama3_function", "qwen3_coder", "glm45", "minimax_m2", "gemma4", "openai"}
)
# The system message for templates that do not render tools themselves.
_INSTRUCTIONS = (
    "You can call these functions:\n{tools}\n\nTo call a function, reply with only a JSON object "
    'such as {{"name": "<function name>", "arguments": {{<arguments>}}}}; to call several, a JSON '
    "list of such objects. Otherwise answer normally."
)


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools, resolved: what the template renders, how to read and to force calls."""

    tools: list[dict[str, Any]]  # OpenAI's [{"type": "function", "function": {...}}]
    parser: ToolParser
    choice: str  # "auto", "required", or "named"
    named: str | None  # the function a named tool_choice forces
    parallel: bool
    in_template: bool  # False: the tools go into a system message

    @classmethod
    def from_body(
        cls, body: Any, chat_template: str | None, parser_name: str
    ) -> ToolRequest | None:
        """None when the request brings no tools or chooses ``none``."""
        tools = body.tools or []
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        named = _named_choice(choice)
        if choice not in ("none", "auto", "required") and named is None:
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        names = [_check_tool(i, tool) for i, tool in enumerate(tools)]
        if not tools:
            if choice in ("required",) or named is not None:
                raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice")
            return None
        if named is not None and named not in names:
            raise bad_request(f"tool_choice names {named!r}, which is not in tools", "tool_choice")
        if choice == "none":
            return None
        detected = parser_for_template(chat_template)
        chosen = parser_name if parser_name != "auto" else detected or "json"
        return cls(
            tools=tools,
            parser=PARSERS[chosen](tools),
            choice="named" if named is not None else choice,
            named=named,
            parallel=body.parallel_tool_calls is not False,
            in_template=detected is not None,
        )

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages to render: unchanged when the template renders tools, else with the
        tools described in a system message of their own at the start."""
        if self.in_template:
            return messages
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in self.tools)
        return [{"role": "system", "content": _INSTRUCTIONS.format(tools=listing)}, *messages]

    def template_kwargs(self) -> dict[str, Any]:
        return {"tools": self.tools} if self.in_template else {}

    def grammar(self) -> str | None:
        """The grammar that forces a call (``required`` or named), else None."""
        if self.choice == "auto":
            return None
        functions = [t["function"] for t in self.tools]
        if self.named is not None:
            functions = [f for f in functions if f["name"] == self.named]
        call = _call_schema(functions, self.parser.name)
        several = self.parallel and self.named is None
        try:
            return lark_grammar(_format_grammar(self.parser.name, call, several))
        except GrammarError as exc:
            raise bad_request(
                f"tools: a parameters schema does not compile: {exc}", "tools"
            ) from None


def _named_choice(choice: Any) -> str | None:
    if not isinstance(choice, dict):
        return None
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict):
        return None
    name = function.get("name")
    return name if isinstance(name, str) and name else None


def _check_tool(index: int, tool: Any) -> str:
    """A tool's function name; a 400 naming ``tools[i]`` when the tool is malformed."""
    param = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise bad_request('each tool must be {"type": "function", "function": {...}}', param)
    name = function.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise bad_request("a function needs a name of 1 to 64 characters", f"{param}.function")
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict):
        raise bad_request("function parameters must be a JSON schema object", f"{param}.function")
    return name


def _call_schema(functions: list[dict[str, Any]], parser: str) -> dict[str, Any]:
    """The JSON schema of one call object of any of ``functions``, in compact JSON.

    Arguments follow the function's parameters; where they do not say whether other keys may
    appear, none may (OpenAI's strict mode), so a forced call ends once its arguments are given.
    """
    key = "parameters" if parser == "llama3_json" else "arguments"
    options = []
    for f in functions:
        parameters = dict(f.get("parameters") or {"type": "object"})
        if parameters.get("type") == "object":
            parameters.setdefault("additionalProperties", False)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: parameters},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    call = options[0] if len(options) == 1 else {"anyOf": options}
    return {**call, "x-guidance": {"whitespace_flexible": False}}


def _format_grammar(parser: str, call: dict[str, Any], several: bool) -> str:
    """A Lark grammar (llguidance's ``%json`` embeds a schema) of calls in ``parser``'s format."""
    schema = json.dumps(call)
    items = {
        "type": "array",
        "items": call,
        "minItems": 1,
        **({} if several else {"maxItems": 1}),
        "x-guidance": call["x-guidance"],
    }
    if parser == "hermes":
        repeat = "+" if several else ""
        return f'start: block{repeat}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {schema}'
    if parser == "mistral":
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json {json.dumps(items)}'
    if parser == "llama3_json":
        repeat = '(";" call)*' if several else ""
        return f"start: call {repeat}\ncall: %json {schema}"
    if parser in _UNFORCED_PARSERS:
        raise bad_request(
            f"tool_choice 'required' or a named function is not supported with the {parser} parser",
            param="tool_choice",
        )
    return f"start: calls\ncalls: %json {json.dumps(items) if several else schema}"


class _Pieces(Protocol):
    def pieces(self) -> AsyncIterator[TextPiece]: ...

    async def aclose(self) -> None: ...

    async def finish(self, reason: str) -> None: ...


class ToolCallPieces:
    """A choice's pieces with its content read by a tool parser (see the module docstring).

    ``forced`` (``required`` or a named function): the grammar allows nothing but calls, so text
    the parser could not read as a call is a call cut off by ``max_tokens`` and is dropped, never
    sent as content. A collected reply keeps only the calls whose arguments are complete JSON.
    """

    def __init__(self, inner: _Pieces, parser: ToolParser, forced: bool = False) -> None:
        self._inner = inner
        self._parser = parser
        self._forced = forced

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def pieces(self) -> AsyncIterator[TextPiece]:
        stream = self._parser.stream()
        guard = RepeatGuard()
        called = False
        logprobs: tuple[TokenLogprobs, ...] = ()
        inner = self._inner.pieces()
        async for piece in inner:
            events = stream.feed(piece.text)
            if piece.finish_reason is not None:
                events += stream.finish()
            events = guard.filter(events, stream.call_open())
            text, calls, reasoning = self._split(events)
            reasoning = piece.reasoning + reasoning
            called = called or bool(calls)
            reason = piece.finish_reason
            if guard.repeated or (reason == "stop" and called):
                reason = "tool_calls"
            logprobs += piece.logprobs
            if guard.repeated and piece.finish_reason is None:
                await inner.aclose()
                # aborts the sequence (its pages are freed at once); counted as finished
                await self._inner.finish("tool_calls")
            if text or calls or reasoning or reason is not None:
                yield replace(
                    piece,
                    text=text,
                    finish_reason=reason,
                    tool_calls=calls,
                    logprobs=logprobs,
                    reasoning=reasoning,
                )
                logprobs = ()
            if guard.repeated:
                return

    def _split(self, events: list[StreamEvent]) -> tuple[str, tuple[ToolCallDelta, ...], str]:
        """The content to send (none when the call is forced), the call deltas, merged, and the
        reasoning of formats that mark it themselves (harmony)."""
        text = "".join(e.text for e in events if isinstance(e, ContentDelta))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        calls = _merged([e for e in events if isinstance(e, ToolCallDelta)])
        return ("" if self._forced else text), calls, reasoning

    async def collect(self) -> TextPiece:
        """The whole reply: content, reasoning, the tool calls reassembled (as OpenAI's
        ``message.tool_calls`` items, in ``tool_calls``), finish reason and usage."""
        content, reasoning, logprobs = [], [], []
        calls: dict[int, dict[str, Any]] = {}
        last: TextPiece | None = None
        async for piece in self.pieces():
            content.append(piece.text)
            reasoning.append(piece.reasoning)
            logprobs += piece.logprobs
            for delta in piece.tool_calls:
                if delta.id is not None:
                    calls[delta.index] = delta.openai()
                else:
                    calls[delta.index]["function"]["arguments"] += delta.arguments
            last = piece
        if last is None:
            raise RuntimeError("the engine stream produced no output")
        ordered = [calls[i] for i in sorted(calls)]
        if last.finish_reason == "length":  # a call cut off mid-arguments is no call
            ordered = [c for c in ordered if _complete_json(c["function"]["arguments"])]
        return replace(
            last,
            text="".join(content),
            reasoning="".join(reasoning),
            logprobs=tuple(logprobs),
            tool_calls=tuple(ordered),
        )


def _complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _merged(deltas: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """Consecutive deltas of one call as one (a chunk carries each call index once)."""
    out: list[ToolCallDelta] = []
    for delta in deltas:
        if out and out[-1].index == delta.index:
            out[-1] = replace(out[-1], arguments=out[-1].arguments + delta.arguments)
        else:
            out.append(delta)
    return tuple(out)


def template_message_tool_calls(tool_calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates expect them: arguments that are a
    JSON object become a dict (templates apply ``tojson`` to them)."""
    out = []
    for call in tool_calls:
        arguments: Any = call.function.arguments
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
        function = {"name": call.function.name, "arguments": arguments}
        out.append({"id": call.id, "type": "function", "function": function})
    return out
