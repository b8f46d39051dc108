"""Shared by the MCP and Responses API tests: the calc MCP server's config, scripted tool-call
replies."""

from __future__ import annotations

import json
import sys
from typing import Any

from jax_llm_runtime.api.mcp.config import McpServerConfig
from tests.serve_process import REPO_ROOT

CALC_SCRIPT = REPO_ROOT / "tests" / "mcp_calc_server.py"


def calc_server(name: str = "calc", **env: str) -> McpServerConfig:
    """The calc MCP server (``tests/mcp_calc_server.py``) over stdio, with ``env`` passed."""
    return McpServerConfig(name, command=sys.executable, args=(str(CALC_SCRIPT),), env=env)


def hermes_call(name: str, **arguments: Any) -> str:
    """A reply calling ``name`` in the hermes format (``<tool_call>`` JSON ``</tool_call>``)."""
    call = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{call}\n</tool_call>"
