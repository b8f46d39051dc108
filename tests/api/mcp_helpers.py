"""Shared by the MCP and Responses API tests: the calc MCP server's config, scripted tool-call
replies, and the app served by uvicorn in a thread (so the openai SDK gets a base URL)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from litestar import Litestar

from api.mcp_config import McpServerConfig
from tests.serve_process import REPO_ROOT

CALC_SCRIPT = REPO_ROOT / "tests" / "mcp_calc_server.py"


def calc_server(name: str = "calc", **env: str) -> McpServerConfig:
    """The calc MCP server (``tests/mcp_calc_server.py``) over stdio, with ``env`` passed."""
    return McpServerConfig(name, command=sys.executable, args=(str(CALC_SCRIPT),), env=env)


def hermes_call(name: str, **arguments: Any) -> str:
    """A reply calling ``name`` in the hermes format (``<tool_call>`` JSON ``</tool_call>``)."""
    call = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{call}\n</tool_call>"


class _ReadyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


@contextmanager
def serve_in_thread(app: Litestar) -> Iterator[str]:
    """Serve ``app`` (lifespan included) on a free port of 127.0.0.1; yields the base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", log_config=None)
    server = _ReadyServer(config)
    thread = threading.Thread(target=server.run, name="mcp-test-server", daemon=True)
    thread.start()
    try:
        while not server.ready.wait(timeout=0.05):
            assert thread.is_alive(), "the app did not start"
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
