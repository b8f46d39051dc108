"""Which tool parser a chat template calls for, from the markup the template itself writes.

A template that can render tool calls writes them back into the history in the very syntax the
model was trained to emit, so its source names the markers. Checked in order:

1. Arguments written as XML elements, not JSON: ``<parameter=`` (Qwen3-Coder, Qwen3.5,
   Nemotron 3, Seed-OSS), ``<arg_key>`` (GLM 4.5+, Ling, Laguna), ``<invoke name=`` (MiniMax).
   No parser here reads them, so None, even though these templates also write ``<tool_call>``.
2. ``[TOOL_CALLS]``: ``mistral``.
3. ``<tool_call>``: ``hermes`` (Hermes, Qwen 2.5 / 3, SmolLM3).
4. ``<function=``: ``llama3_function`` (Functionary v3.1, custom Llama 3.1 prompts).
5. ``<|python_tag|>``, or ``"parameters"`` in a Llama 3 header template: ``llama3_json``.
6. Any other template that uses the ``tools`` variable: ``json``, the generic reader, since such
   a template tells the model about tools without showing a syntax this package knows.
7. Otherwise the template has no tool support: None.
"""

from __future__ import annotations

import jinja2

_XML_ARGUMENTS = ("<parameter=", "<arg_key>", "<invoke name=")


def parser_for_template(chat_template: str | None) -> str | None:
    """The name in ``PARSERS`` of the parser for replies of a model with this chat template,
    or None when the template renders no tools or uses a format no parser here reads."""
    if not chat_template:
        return None
    if any(marker in chat_template for marker in _XML_ARGUMENTS):
        return None
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<function=" in chat_template:
        return "llama3_function"
    if "<|python_tag|>" in chat_template or (
        '"parameters"' in chat_template and "<|start_header_id|>" in chat_template
    ):
        return "llama3_json"
    return "json" if _uses_tools(chat_template) else None


def _uses_tools(chat_template: str) -> bool:
    """Whether the template reads a variable named ``tools`` (not just says the word)."""
    try:
        tokens = list(jinja2.Environment().lex(chat_template))
    except jinja2.TemplateSyntaxError:
        return False  # it could not render either
    return any(kind == "name" and value == "tools" for _, kind, value in tokens)
