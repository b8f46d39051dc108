"""The operator's MCP servers: the common ``mcp.json`` format, read and checked.

::

    {"mcpServers": {
        "<name>": {"command": "...", "args": ["..."], "env": {"KEY": "value"}},   (stdio)
        "<name>": {"url": "https://.../mcp", "headers": {"Authorization": "..."}}  (streamable HTTP)
    }}

An optional ``"type"`` must name the transport the entry implies (``stdio``; ``http`` or
``streamable-http``); SSE servers are not supported. Names are 1-32 of ``A-Z a-z 0-9 _ -``: they
prefix the server's tool names (``api.mcp.client``), which OpenAI limits to 64 such characters. Any
other key, or a value of the wrong type, is a
``ValueError`` naming the server and the key, so ``runtime-serve`` stops with one line at startup.
This module imports nothing of the ``mcp`` SDK.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_STDIO_KEYS = {"command", "args", "env", "type"}
_HTTP_KEYS = {"url", "headers", "type"}
_HTTP_TYPES = ("http", "streamable-http", "streamableHttp")  # the names configs use for it


@dataclass(frozen=True)
class McpServerConfig:
    """One MCP server: a command to run (stdio) or a URL (streamable HTTP), never both."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not SERVER_NAME.match(self.name):
            raise ValueError(
                f"MCP server name {self.name!r} must be 1 to 32 letters, digits, '_' or '-'"
            )
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r} needs either a command or a url")
        if self.command is not None and not self.command:
            raise ValueError(f"MCP server {self.name!r}: the command must not be empty")
        if self.url is not None and not re.match(r"^https?://", self.url):
            raise ValueError(
                f"MCP server {self.name!r}: the url must start with http:// or https://"
            )

    def describe(self) -> str:
        """What the server is, for messages: its command line or its URL."""
        return self.url or " ".join([self.command or "", *self.args])


def _strings(server: str, key: str, value: Any, kind: type) -> Any:
    """``value`` checked as a list of strings (``kind`` list) or a string-to-string object."""
    if kind is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if kind is dict and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    shape = "a list of strings" if kind is list else "an object of strings"
    raise ValueError(f"MCP server {server!r}: {key!r} must be {shape}")


def server_config(name: str, entry: Any) -> McpServerConfig:
    """One ``mcpServers`` entry as a ``McpServerConfig`` (ValueError when malformed)."""
    if not isinstance(entry, dict):
        raise ValueError(f"MCP server {name!r} must be an object")
    allowed = _HTTP_KEYS if "url" in entry else _STDIO_KEYS
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ValueError(
            f"MCP server {name!r}: unknown keys {', '.join(unknown)} (allowed: "
            f"{', '.join(sorted(allowed - {'type'}))})"
        )
    for key in ("command", "url"):
        if key in entry and not isinstance(entry[key], str):
            raise ValueError(f"MCP server {name!r}: {key!r} must be a string")
    kinds = _HTTP_TYPES if "url" in entry else ("stdio",)
    if entry.get("type", kinds[0]) not in kinds:
        raise ValueError(
            f"MCP server {name!r}: type {entry['type']!r} is not supported here "
            f"(use {' or '.join(kinds)})"
        )
    return McpServerConfig(
        name=name,
        command=entry.get("command"),
        args=_strings(name, "args", entry.get("args", []), list),
        env=_strings(name, "env", entry.get("env", {}), dict),
        url=entry.get("url"),
        headers=_strings(name, "headers", entry.get("headers", {}), dict),
    )


def load_mcp_config(path: str) -> tuple[McpServerConfig, ...]:
    """The servers of an ``mcp.json`` file; ValueError naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read the MCP config {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the MCP config {path} is not valid JSON: {exc}") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise ValueError(f'the MCP config {path} must be {{"mcpServers": {{name: server, ...}}}}')
    try:
        return tuple(server_config(name, entry) for name, entry in servers.items())
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
