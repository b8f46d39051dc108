"""A small MCP server for tests, built on the official ``mcp`` SDK's server side.

``python tests/mcp_calc_server.py`` serves over stdio; ``--http PORT`` serves streamable HTTP on
127.0.0.1:PORT at ``/mcp``. Its tools add numbers, echo text, sleep, read an environment variable,
return large text, create a file, fail on purpose, and carry names that need namespacing.
"""

from __future__ import annotations

import argparse
import asyncio
import os

try:  # mcp 2.x
    from mcp.server.mcpserver import MCPServer as Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as Server  # type: ignore[no-redef]
    from mcp.server.fastmcp.exceptions import ToolError  # type: ignore[no-redef]

LONG_NAME = "a_tool_whose_name_is_long_enough_to_pass_the_sixty_four_character_limit"

server = Server("calc", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
async def sleep(seconds: float) -> str:
    """Wait for some seconds, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def env(name: str) -> str:
    """The value of an environment variable of this server's process, or <unset>."""
    return os.environ.get(name, "<unset>")


@server.tool()
def big(size: int) -> str:
    """A text of ``size`` characters."""
    return "x" * size


@server.tool()
def touch(path: str) -> str:
    """Create an empty file at ``path`` (tests look for it to see whether a call ran)."""
    with open(path, "a", encoding="utf-8"):
        pass
    return "done"


@server.tool()
def fail(reason: str) -> str:
    """Always fails with the reason given."""
    raise ToolError(reason)


@server.tool(name="web.search")
def web_search(query: str) -> str:
    """A tool whose name holds a character that function names cannot."""
    return f"results for {query}"


@server.tool(name=LONG_NAME)
def long_name() -> str:
    """A tool whose namespaced name is longer than 64 characters."""
    return "long"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None, metavar="PORT")
    args = parser.parse_args()
    if args.http is None:
        server.run()
        return
    try:  # mcp 2.x takes the address here
        server.run(transport="streamable-http", host="127.0.0.1", port=args.http)
    except TypeError:  # mcp 1.x reads it from the settings
        server.settings.host = "127.0.0.1"
        server.settings.port = args.http
        server.run(transport="streamable-http")


if __name__ == "__main__":
    main()
