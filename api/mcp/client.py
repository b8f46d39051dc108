"""MCP servers' tools for the model: connected at startup, listed once, called by name.

1. ``McpClients.connect`` (the app's lifespan, before the engine starts) connects to every server
   of the operator's ``mcp.json`` (``api.mcp.config``) with the official ``mcp`` SDK: stdio for a
   command, streamable HTTP for a URL. Each connection lives in a task of its own, which enters
   and leaves the SDK's context managers (they hold anyio task groups) and keeps the session open
   until ``close``. A server that cannot be started, initialized or listed within
   ``CONNECT_TIMEOUT_S`` stops the startup with ``McpStartupError``, one line naming it: the
   operator asked for these tools, so serving without some of them would change every request's
   prompt without a word.
2. A stdio server runs with a minimal environment: the SDK's short list of inherited variables
   (``HOME``, ``PATH``, ``USER``, ``SHELL``, ``TERM``, ``LOGNAME``) plus the config's ``env``;
   nothing else of the server's environment (API keys, tokens) reaches it.
3. Tools are named ``<server>__<tool>``, with characters outside ``A-Z a-z 0-9 _ -`` replaced by
   ``_`` and names past OpenAI's 64 characters (or clashing after that) cut and ended with a
   hash of the original, so they stay unique; ``McpTool`` keeps the server's own name.
4. ``call`` runs one tool under a per-call timeout. Whatever happens (bad arguments, a tool
   error, a timeout, a dead server) it returns an ``McpResult`` whose ``text`` is what the model
   reads next; text past ``max_output_bytes`` is cut, and the cut says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from jax_llm_runtime.api.mcp.config import McpServerConfig

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # start, initialize and list one server
MAX_TOOL_NAME = 64  # OpenAI's limit on function names
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
# JSON-RPC codes for failures on our side of a call (the MCP SDK's REQUEST_TIMEOUT is -32001).
TIMEOUT_CODE = -32001
INTERNAL_CODE = -32603


class McpStartupError(RuntimeError):
    """An MCP server could not be connected at startup (the message is one line)."""


@dataclass(frozen=True)
class McpTool:
    """One server tool as the model sees it (``name``) and as the server knows it (``tool``)."""

    name: str
    server: str
    tool: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as an OpenAI chat ``tools`` item."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class McpResult:
    """A finished call: ``text`` for the model; ``error`` (OpenAI's ``mcp_call.error`` object)
    when the call failed, in which case ``text`` describes the failure."""

    text: str
    error: dict[str, Any] | None = None


def namespaced_names(server: str, tools: list[str], taken: set[str]) -> list[str]:
    """``<server>__<tool>`` for each tool, safe, at most 64 characters, unique among ``taken``
    (which grows by the names returned)."""
    out = []
    for tool in tools:
        name = f"{server}__{_UNSAFE.sub('_', tool)}"
        if len(name) > MAX_TOOL_NAME or name in taken:
            digest = hashlib.sha256(f"{server}/{tool}".encode()).hexdigest()[:8]
            name = f"{name[: MAX_TOOL_NAME - 9]}_{digest}"
        taken.add(name)
        out.append(name)
    return out


def cut_to_bytes(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` UTF-8 bytes, else its head and a note of the cut."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    head = data[:limit].decode("utf-8", errors="ignore")
    return f"{head}\n[output truncated: {len(data)} bytes, limit {limit}]"


def result_text(result: dict[str, Any]) -> str:
    """The text of an MCP ``CallToolResult`` (wire form): its text blocks, resources' text,
    a note for each binary block; the structured content when there is no text at all."""
    parts = []
    for block in result.get("content") or []:
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text", ""))
        elif kind == "resource" and "text" in block.get("resource", {}):
            parts.append(block["resource"]["text"])
        elif kind == "resource_link":
            parts.append(f"[resource: {block.get('uri', '')}]")
        else:
            parts.append(f"[{kind} content: {block.get('mimeType', 'binary')}]")
    if not parts and result.get("structuredContent") is not None:
        return json.dumps(result["structuredContent"], ensure_ascii=False)
    return "\n".join(parts)


def _one_line(exc: BaseException) -> str:
    """The innermost message of an exception (anyio wraps transport failures in groups)."""
    while getattr(exc, "exceptions", None):  # an ExceptionGroup: its first leaf
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    error = getattr(exc, "error", None)  # the SDK's McpError / MCPError carry ErrorData
    text = getattr(error, "message", None) or str(exc) or type(exc).__name__
    return " ".join(text.split())


class _Connection:
    """One server's session, held open by a task of its own until ``stop``."""

    def __init__(self, server: McpServerConfig) -> None:
        self.server = server
        self.session: Any = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def open(self, timeout_s: float) -> list[dict[str, Any]]:
        """Start the session task; the server's tools (wire form) once it is initialized."""
        ready: asyncio.Future[list[dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(ready), name=f"mcp-{self.server.name}")
        try:
            return await asyncio.wait_for(asyncio.shield(ready), timeout_s)
        except asyncio.TimeoutError:
            await self._abort()
            raise McpStartupError(
                f"MCP server {self.server.name!r} ({self.server.describe()}) did not answer "
                f"within {timeout_s:g} s"
            ) from None
        except Exception as exc:
            await self._abort()
            raise McpStartupError(
                f"MCP server {self.server.name!r} ({self.server.describe()}) could not be "
                f"connected: {_one_line(exc)}"
            ) from None

    async def _hold(self, ready: asyncio.Future[list[dict[str, Any]]]) -> None:
        from mcp import ClientSession

        try:
            async with AsyncExitStack() as stack:
                read, write = await _transport(stack, self.server)
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                listed = await session.list_tools()
                if getattr(listed, "nextCursor", None) or getattr(listed, "next_cursor", None):
                    logger.warning(
                        "MCP server %r lists more tools than one page; only the first page is used",
                        self.server.name,
                    )
                self.session = session
                ready.set_result([t.model_dump(mode="json", by_alias=True) for t in listed.tools])
                await self._stop.wait()
        except BaseException as exc:
            self.session = None
            if not ready.done():  # ``open`` is waiting: it reports the failure
                if isinstance(exc, Exception):
                    ready.set_exception(exc)
                else:
                    ready.cancel()
            elif self._stop.is_set():  # closing: transports may end with an error of their own
                logger.debug("MCP server %r closed: %s", self.server.name, _one_line(exc))
            elif not isinstance(exc, asyncio.CancelledError):
                logger.warning("MCP server %r disconnected: %s", self.server.name, _one_line(exc))
            if not isinstance(exc, Exception):  # cancellation, interrupts: not ours to keep
                raise

    async def _abort(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})

    async def stop(self) -> None:
        """Close the session (and end a stdio server's process). Idempotent."""
        self._stop.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), CONNECT_TIMEOUT_S)
            except asyncio.TimeoutError:
                await self._abort()
            except Exception as exc:  # the task logged it; closing goes on for the others
                logger.debug("MCP server %r closed with %s", self.server.name, exc)


async def _transport(stack: AsyncExitStack, server: McpServerConfig) -> tuple[Any, Any]:
    """The SDK's (read, write) streams for ``server``, entered on ``stack``."""
    if server.command is not None:
        from mcp import StdioServerParameters
        from mcp.client.stdio import get_default_environment, stdio_client

        params = StdioServerParameters(
            command=server.command,
            args=list(server.args),
            env={**get_default_environment(), **server.env},
        )
        read, write = await stack.enter_async_context(stdio_client(params))
        return read, write
    assert server.url is not None
    try:  # mcp 2: one function, headers on the HTTP client it is given
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client
    except ImportError:  # mcp 1.x: headers as an argument, and a third item (the session id)
        from mcp.client.streamable_http import streamablehttp_client

        streams = await stack.enter_async_context(
            streamablehttp_client(server.url, headers=server.headers or None)
        )
        return streams[0], streams[1]
    client = await stack.enter_async_context(create_mcp_http_client(headers=server.headers))
    streams = await stack.enter_async_context(
        streamable_http_client(server.url, http_client=client)
    )
    return streams[0], streams[1]


class McpClients:
    """The connected servers and their tools; see the module docstring."""

    def __init__(
        self,
        servers: tuple[McpServerConfig, ...] = (),
        timeout_s: float = 60.0,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> None:
        self.servers = servers
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        self.tools: tuple[McpTool, ...] = ()
        self.startup_error: McpStartupError | None = None
        self._connections: dict[str, _Connection] = {}
        self._by_name: dict[str, McpTool] = {}

    async def connect(self) -> None:
        """Connect every server and list its tools; McpStartupError (after closing the ones
        already open) when one fails."""
        taken: set[str] = set()
        try:
            for server in self.servers:
                connection = _Connection(server)
                listed = await connection.open(CONNECT_TIMEOUT_S)
                self._connections[server.name] = connection
                self._add_tools(server.name, listed, taken)
                logger.info("MCP server %r: %d tools", server.name, len(listed))
        except McpStartupError as exc:
            self.startup_error = exc
            self.tools, self._by_name = (), {}
            await self.close()
            raise

    def _add_tools(self, server: str, listed: list[dict[str, Any]], taken: set[str]) -> None:
        names = namespaced_names(server, [t["name"] for t in listed], taken)
        for name, tool in zip(names, listed, strict=True):
            schema = tool.get("inputSchema")
            mcp_tool = McpTool(
                name=name,
                server=server,
                tool=tool["name"],
                description=tool.get("description") or "",
                parameters=schema if isinstance(schema, dict) else {"type": "object"},
            )
            self._by_name[name] = mcp_tool
        self.tools = tuple(self._by_name.values())

    async def close(self) -> None:
        """Close every session."""
        connections, self._connections = list(self._connections.values()), {}
        for connection in connections:
            await connection.stop()

    def find(self, name: str) -> McpTool | None:
        """The tool the model knows as ``name``, if it is an MCP tool."""
        return self._by_name.get(name)

    def openai_tools(self) -> list[dict[str, Any]]:
        """Every tool as OpenAI chat ``tools`` items."""
        return [tool.openai() for tool in self.tools]

    async def call(self, tool: McpTool, arguments: str) -> McpResult:
        """Run ``tool`` with ``arguments`` (JSON text, as the model wrote it); never raises
        except on cancellation."""
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            return self._failed(INTERNAL_CODE, "the arguments are not a JSON object")
        connection = self._connections.get(tool.server)
        session = connection.session if connection is not None else None
        if session is None:
            return self._failed(INTERNAL_CODE, f"MCP server {tool.server!r} is not connected")
        try:
            result = await asyncio.wait_for(session.call_tool(tool.tool, parsed), self.timeout_s)
        except asyncio.TimeoutError:
            return self._failed(TIMEOUT_CODE, f"the tool timed out after {self.timeout_s:g} s")
        except Exception as exc:  # a protocol error or a dead server: the model is told
            return self._failed(
                getattr(getattr(exc, "error", None), "code", INTERNAL_CODE), _one_line(exc)
            )
        wire = result.model_dump(mode="json", by_alias=True)
        text = cut_to_bytes(result_text(wire), self.max_output_bytes)
        if wire.get("isError"):
            content = [{"type": "text", "text": text}]
            return McpResult(text, {"type": "mcp_tool_execution_error", "content": content})
        return McpResult(text)

    def _failed(self, code: int, message: str) -> McpResult:
        error = {"type": "mcp_protocol_error", "code": code, "message": message}
        return McpResult(f"Error: {message}", error)
