"""Which tool parser a chat template calls for, from the markup the template itself writes.

A template that can render tool calls writes them back into the history in the very syntax the
model was trained to emit, so its source names the markers. Checked in order:

1. ``<|channel|>``: ``openai`` (gpt-oss and its harmony messages).
2. ``<|tool_call>`` (Gemma 4's call token, which no other format writes): ``gemma4``.
3. Arguments written as XML elements, not JSON: ``<arg_key>`` (GLM 4.5+, GLM-4-MoE-lite, and
   any other template that writes GLM's pairs): ``glm45``; ``<invoke name=`` with
   ``<minimax:tool_call>`` (MiniMax-M2): ``minimax_m2``; ``<parameter=`` with ``<tool_call>``
   or ``<function=`` (Qwen3-Coder, Qwen3.5, Qwen3-Next, Nemotron 3): ``qwen3_coder``. Other
   XML forms (Seed-OSS's ``<seed:tool_call>``) have no parser here: None.
4. ``[TOOL_CALLS]``: ``mistral``.
5. ``<tool_call>``: ``hermes`` (Hermes, Qwen 2.5 / 3, SmolLM3).
6. ``<function=``: ``llama3_function`` (Functionary v3.1, custom Llama 3.1 prompts).
7. ``<|python_tag|>``, or ``"parameters"`` in a Llama 3 header template: ``llama3_json``.
8. Any other template that uses the ``tools`` variable: ``json``, the generic reader, since such
   a template tells the model about tools without showing a syntax this package knows.
9. Otherwise the template has no tool support: None.
"""

from __future__ import annotations

import jinja2

_XML_ARGUMENTS = ("<parameter=", "<arg_key>", "<invoke name=")


def parser_for_template(chat_template: str | None) -> str | None:
    """The name in ``PARSERS`` of the parser for replies of a model with this chat template,
    or None when the template renders no tools or uses a format no parser here reads."""
    if not chat_template:
        return None
    if "<|channel|>" in chat_template:
        return "openai"
    if "<|tool_call>" in chat_template:
        return "gemma4"
    if any(marker in chat_template for marker in _XML_ARGUMENTS):
        return _xml_format(chat_template)
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


def _xml_format(chat_template: str) -> str | None:
    if "<arg_key>" in chat_template:
        return "glm45"
    if "<minimax:tool_call>" in chat_template:
        return "minimax_m2" if "<invoke name=" in chat_template else None
    qwen = "<tool_call>" in chat_template or "<function=" in chat_template
    if "<parameter=" in chat_template and qwen and "<seed:tool_call>" not in chat_template:
        return "qwen3_coder"
    return None


def _uses_tools(chat_template: str) -> bool:
    """Whether the template reads a variable named ``tools`` (not just says the word)."""
    try:
        tokens = list(jinja2.Environment().lex(chat_template))
    except jinja2.TemplateSyntaxError:
        return False  # it could not render either
    return any(kind == "name" and value == "tools" for _, kind, value in tokens)
