"""Tool calls out of generated text: whole replies (``parse``) and streams (``stream``).

The parsers are pure Python over the reply's text, which must be decoded with the special tokens
that serve as markers kept (``[TOOL_CALLS]``, ``<|python_tag|>``, ``<tool_call>`` in Qwen).

Formats
-------
``ws`` is JSON whitespace; ``text`` is any reply text, sent as content. A *call object* is a JSON
object with, in any order (Hermes writes ``"arguments"`` first, Qwen ``"name"`` first):

    "name":                      a string, non-empty once trimmed (required)
    "arguments" | "parameters":  an object, opening as ``{`` ws (``"`` | ``}``), or a string
                                 (the first of these keys counts, the others are ignored)
    "function":                  a call object whose name and arguments fill this one
                                 (OpenAI's nesting: ``{"type": "function", "function": {...}}``)
    any other key:               any JSON value, ignored (``"id"``, ``"type"``)

``mistral`` (Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small 3.x, Ministral, Devstral, Magistral)::

    text* ( "[TOOL_CALLS]" ws ( list | call-object | bare-call ) text* )*
    list      = "[" ws [ call-object ( ws "," ws call-object )* ] ws "]"    (tokenizers v2-v7)
    bare-call = NAME [ "[CALL_ID]" ID ] "[ARGS]" ws object                  (v11 and later)

  NAME is 1-256 of ``A-Z a-z 0-9 _ . : -``. Each call of the newer form has its own
  ``[TOOL_CALLS]``. The model's ``[CALL_ID]`` is not used (see ids below).

``hermes`` (Hermes 2 Pro / 3, Qwen 2.5 / 3, Granite 4, SmolLM3)::

    text* ( "<tool_call>" ws item ( ws item )* ws "</tool_call>" text* )*
    item = call-object | list     (lists, as in the mistral grammar, come from some fine-tunes)

``llama3_json`` (Llama 3.1 / 3.2 / 3.3 custom tools)::

    ws calls text*   |   text* "<|python_tag|>" ws calls text*
    calls = call-object ( ws [ ";" ws ] call-object )* [ ws ";" ]

  Arguments are required here: a reply that merely is a JSON object with a ``"name"`` is an
  answer, not a call. Llama's built-in tools (``<|python_tag|>brave_search.call(query="x")``)
  are not JSON and pass through as content.

``llama3_function`` (Llama 3.1's ``<function=...>`` prompt format, Functionary v3.1)::

    text* ( "<function=" NAME ">" ws object ws "</function>" text* )*

``json`` (any model asked to answer in JSON)::

    ws ( call-object | list | "{" ws "\\"tool_calls\\"" ws ":" ws list ( ws "," member )* ws "}" ) text*

  Arguments are required, for the same reason as ``llama3_json``. Until such a reply's JSON
  proves not to be a call, it is held back, so a plain JSON answer streams at its end.

``arguments``
-------------
The text of the arguments exactly as the model wrote it, from the ``{`` to its matching ``}``;
for arguments the model wrote as a JSON string, that string's value with surrounding whitespace
trimmed; ``{}`` for a call object without arguments (hermes, mistral). It is not re-serialized,
so a stream can send it character by character as the model writes it and ``parse`` gives the
same string. Like OpenAI's, it is usually valid JSON but not always: validate before use.

Ids
---
``call_`` and 24 random letters or digits, as OpenAI's, except ``mistral``: 9 letters or digits,
the only shape Mistral's templates accept when the call comes back in the history. Ids are always
fresh, never taken from the model, so they are unique within a reply.

Streaming contract
------------------
``stream()`` gives a ``ToolCallStream``; ``feed(delta)`` returns the events the new text made
final and ``finish()`` the rest. An event is a ``ContentDelta`` or a ``ToolCallDelta``, whose
``openai()`` is OpenAI's streamed ``delta.tool_calls`` item.

1. Content is the text outside markup. What could still become a marker is held back (as stop
   strings are), and so is trailing whitespace: whitespace right before markup is dropped, and
   whitespace right after it is sent only when text follows and content came before.
2. A call is announced (``{index, id, type, function: {name, arguments: ""}}``) once its name is
   known and its arguments have begun (an object's ``{`` and next token) or are complete (a
   string, or the call object closed without them). From then on each fragment
   (``{index, function: {arguments}}``) is the arguments text as it arrives; whitespace between
   tokens is held until what follows it arrives. The fragments concatenate to ``arguments``.
3. Fallback. Markup that breaks the grammar before any call in it was announced, or that ends
   with no call in it (``<tool_call></tool_call>``, ``[]``), is content, exactly as if its
   marker had been ordinary text; reading goes on after the marker, so a later well-formed call
   is still found. With no call announced anywhere the content is the whole reply, verbatim.
   Markup that breaks after a call in it was announced cannot be taken back: the open call ends
   with the arguments sent so far (a reply cut off by ``max_tokens`` gives truncated JSON, as
   OpenAI does), a ``</tool_call>`` or ``</function>`` at the break still closes its block, and
   the text from the break on (or from the end of the last complete call, when the break comes
   before the next call is announced) is content.
4. ``parse(text)`` is the stream fed ``text`` at once, reassembled; every decision depends only on
   the text, never on where it was cut, so stream and parse agree on content and calls (ids
   aside) for any reply and any cuts. No input makes a parser raise.
"""

from __future__ import annotations

from jax_llm_runtime.api.tool_calling.parsers.detect import parser_for_template
from jax_llm_runtime.api.tool_calling.parsers.events import (
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    collect,
)
from jax_llm_runtime.api.tool_calling.parsers.formats import (
    HermesParser,
    JsonParser,
    Llama3FunctionParser,
    Llama3JsonParser,
    MistralParser,
)
from jax_llm_runtime.api.tool_calling.parsers.harmony import HarmonyParser, HarmonyStream
from jax_llm_runtime.api.tool_calling.parsers.stream import ToolCallStream, ToolParser
from jax_llm_runtime.api.tool_calling.parsers.xml_calls import (
    Glm45Parser,
    MiniMaxM2Parser,
    Qwen3CoderParser,
)

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (
        MistralParser,
        Llama3JsonParser,
        Llama3FunctionParser,
        HermesParser,
        JsonParser,
        Qwen3CoderParser,
        Glm45Parser,
        MiniMaxM2Parser,
        HarmonyParser,
    )
}

__all__ = [
    "PARSERS",
    "ContentDelta",
    "HarmonyStream",
    "ParsedOutput",
    "ReasoningDelta",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "collect",
    "parser_for_template",
]
