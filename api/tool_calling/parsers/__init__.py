"""Tool calls out of generated text: whole replies (``parse``) and streams (``stream``).

The parsers are pure Python over the reply's text, which must be decoded with the special tokens
that serve as markers kept (``[TOOL_CALLS]``, ``<|python_tag|>``, ``<tool_call>`` in Qwen,
harmony's ``<|channel|>`` and the rest in gpt-oss, Gemma 4's ``<|tool_call>`` and ``<|"|>``):
the chat route decodes with ``skip_special_tokens=False`` whenever a request has tools, and
always for a model whose reasoning markers are special tokens (harmony, Gemma 4).

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

Arguments as XML elements, one per parameter. ``VALUE`` is any text up to the tag that ends
it; ``KEY`` and ``NAME`` are 1-256 characters, trimmed, without ``< > { } [ ] "`` or line breaks:

``qwen3_coder`` (Qwen3-Coder, Qwen3.5, Qwen3-Next, Nemotron 3)::

    text* ( ( "<tool_call>" ws function ( ws function )* ws [ "</tool_call>" ]
            | function ) text* )*
    function  = "<function=" NAME ">" ( ws parameter )* ws "</function>"
    parameter = "<parameter=" KEY ">" VALUE [ "</parameter>" ]

  VALUE loses one newline at each end (the template writes ``>\nVALUE\n<``). A value whose
  ``</parameter>`` is missing ends at the next ``<parameter=``, ``</function>`` or
  ``</tool_call>``; a ``</tool_call>`` also closes a function left open.

``glm45`` (GLM 4.5 / 4.6 / 4.7, GLM-4-MoE-lite)::

    text* ( "<tool_call>" ws NAME ( ws "<arg_key>" KEY "</arg_key>" ws
            "<arg_value>" VALUE "</arg_value>" )* ws "</tool_call>" text* )*

  NAME ends at a line break or ``<arg_key>`` (GLM 4.7 writes none between). VALUE is trimmed.

``minimax_m2`` (MiniMax-M2)::

    text* ( "<minimax:tool_call>" ws invoke ( ws invoke )* ws "</minimax:tool_call>" text* )*
    invoke    = "<invoke name=" Q NAME Q ">" ( ws parameter )* ws "</invoke>"
    parameter = "<parameter name=" Q KEY Q ">" VALUE "</parameter>"

  Q is ``"``, ``'`` or nothing. VALUE is trimmed.

  Values are typed by the request's tool schemas (``schemas.typed_value``): a string, unless
  the parameter's schema allows only non-string types and VALUE parses as JSON.

``gemma4`` (Gemma 4)::

    text* ( "<|tool_call>" ws "call:" NAME object [ ws "<tool_call|>" ] text* )*
    object = "{" ws [ member ( ws "," ws member )* [ ws "," ] ] ws "}"
    member = ( KEY | Q KEY Q ) ws ":" ws value
    value  = Q STRING Q | object | list | BARE
    list   = "[" ws [ value ( ws "," ws value )* [ ws "," ] ] ws "]"

  Q is the quote token ``<|"|>``; STRING is any text up to the next Q, nothing escaped (a
  call marker in it means it was never closed). KEY is 1-256 characters up to its ``:``,
  trimmed, without ``{ } [ ] , < > "`` or line breaks; NAME 1-256 characters without
  whitespace or ``{ } ( ) < > [ ] " , : ; '``. BARE runs to whitespace or ``, { } [ ] < >``:
  a JSON number as written, ``true``, ``false``, ``null`` (or Python's ``True``, ``False``,
  ``None``, which Jinja writes), else a string of that text. A call the reply ends right
  after needs no ``<tool_call|>``.

``openai`` (gpt-oss: OpenAI's harmony format)::

    reply   = ( text | message )*
    message = header "<|message|>" body [ "<|end|>" | "<|call|>" | "<|return|>" ]
    header  = ( "<|start|>" ROLE | "<|channel|>" CHANNEL ) ( part )*      (at most 512 chars)
    part    = "<|channel|>" CHANNEL | " to=" RECIPIENT | "<|constrain|>" TYPE | " " TYPE

  The prompt ends with ``<|start|>assistant``, so a reply opens with its first channel. A body
  ends at its end token, where the next ``<|start|>`` or ``<|channel|>`` begins, or with the
  reply (``<|call|>`` and ``<|return|>`` are stop tokens a reply may end without). A message to
  ``functions.NAME`` (on any channel, ``to=`` before or after the channel) is a call whose
  arguments are its body; to any other recipient (``browser.search``, ``python``: built-in tools
  this server does not run), nothing; on ``analysis``, reasoning (``ReasoningDelta``); on
  ``final``, ``commentary`` (a preamble) or none, content. Bodies are sent verbatim, content
  bodies concatenated. A header that breaks the grammar is content from its first marker, and
  reading goes on after that marker. Whitespace rules 1 and 3 below do not apply here.

``arguments``
-------------
The text of the arguments exactly as the model wrote it, from the ``{`` to its matching ``}``;
for arguments the model wrote as a JSON string, that string's value with surrounding whitespace
trimmed; ``{}`` for a call object without arguments (hermes, mistral). It is not re-serialized,
so a stream can send it character by character as the model writes it and ``parse`` gives the
same string. Like OpenAI's, it is usually valid JSON but not always: validate before use.
The XML formats are the exception: their arguments are the JSON object of the parameters,
written by the parser (``json.dumps`` of each key and typed value, ``", "`` and ``": "``
between them), sent a parameter at a time as each one's value closes; ``{}`` without any.
So is ``gemma4``, whose notation is not JSON: the parser writes ``json.dumps`` of the arguments
object, sending strings as their text arrives and other values as each one ends.

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
   known (XML formats and harmony: as soon as its name or header is read; gemma4: at the ``{``
   after its name) and its arguments have begun (an object's ``{`` and next token) or are complete (a
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
from jax_llm_runtime.api.tool_calling.parsers.gemma4 import Gemma4Parser
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
        Gemma4Parser,
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
