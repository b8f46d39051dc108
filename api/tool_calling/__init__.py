"""Tool calling on /v1/chat/completions: tools rendered into the prompt, and tool calls parsed out
of the reply, whole or streamed (``parsers``), in each model family's markup.
"""
