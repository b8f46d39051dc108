"""The HTTP side: a Litestar app (``app``) serving OpenAI-compatible routes (``routes``) in the
OpenAI wire format (``protocol``), turning requests into engine streams and engine streams into
text and server-sent events (``generation``), with the Responses API (``responses``), tool calling
(``tool_calling``), MCP tools (``mcp``), the service concerns every route sits behind
(``service``), the web chat UI (``ui``) and the command lines (``cli``).
"""
