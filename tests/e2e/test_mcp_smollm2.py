"""``runtime-serve --mcp-config`` with the embedded default model and the stdio calc MCP server
(``tests/mcp_calc_server.py``): /v1/responses forces the MCP tool, runs it, and the model answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest

from tests.serve_process import REPO_ROOT, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_forced_mcp_call_runs_and_the_model_answers(smollm2_gguf: Path, tmp_path: Path) -> None:
    config = tmp_path / "mcp.json"
    calc = {"command": sys.executable, "args": [str(REPO_ROOT / "tests" / "mcp_calc_server.py")]}
    config.write_text(json.dumps({"mcpServers": {"calc": calc}}))
    args = ["--max-model-len", "2048", "--max-num-seqs", "2", "--mcp-config", str(config)]
    log = tmp_path / "server.log"
    with running_server([*args, "--mcp-max-rounds", "1"], log) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
        response = client.responses.create(
            model=server.model,
            input="What is 2 plus 3?",
            tool_choice={"type": "function", "name": "calc__add"},
            max_output_tokens=64,
            temperature=0,
        )
    call, *_, answer = response.output
    assert call.type == "mcp_call" and (call.server_label, call.name) == ("calc", "add")
    arguments = json.loads(call.arguments)
    assert call.status == "completed" and call.output == str(arguments["a"] + arguments["b"])
    assert answer.type == "message" and answer.content[0].text.strip()
    assert response.output_text == answer.content[0].text
    assert response.usage.output_tokens <= 64
    assert "Traceback" not in log.read_text()
