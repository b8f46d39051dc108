"""MCP servers (``api.mcp.client``): a real stdio server (``tests/mcp_calc_server.py``, the official SDK's
server side) and a streamable HTTP one; names, limits, environment, startup errors, the config
file, and the tools reaching chat requests (which get the calls back, never run here)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.mcp.client import MAX_TOOL_NAME, McpClients, McpStartupError
from jax_llm_runtime.api.mcp.config import McpServerConfig, load_mcp_config
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.inprocess import serve_in_thread
from tests.api.mcp_helpers import CALC_SCRIPT, calc_server, hermes_call
from tests.serve_process import REPO_ROOT

LONG_NAME = "a_tool_whose_name_is_long_enough_to_pass_the_sixty_four_character_limit"
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


async def test_tools_are_listed_namespaced_and_called() -> None:
    clients = McpClients((calc_server(),))
    await clients.connect()
    try:
        names = {tool.name for tool in clients.tools}
        assert {"calc__add", "calc__echo", "calc__web_search"} <= names
        long = next(tool for tool in clients.tools if tool.tool == LONG_NAME)
        assert len(long.name) == MAX_TOOL_NAME and long.name.startswith("calc__a_tool_whose")
        assert all(len(n) <= MAX_TOOL_NAME and n.replace("_", "").isalnum() for n in names)
        add = clients.find("calc__add")
        assert add is not None and (add.server, add.tool) == ("calc", "add")
        function = add.openai()["function"]
        assert function["description"] == "Add two integers."
        assert function["parameters"]["required"] == ["a", "b"]
        assert (await clients.call(add, '{"a": 2, "b": 3}')).text == "5"
        search = clients.find("calc__web_search")
        assert search is not None and search.tool == "web.search"
        assert (await clients.call(search, '{"query": "jax"}')).text == "results for jax"
        failed = await clients.call(clients.find("calc__fail"), '{"reason": "no luck"}')
        assert failed.error is not None and failed.error["type"] == "mcp_tool_execution_error"
        assert "no luck" in failed.text
        bad = await clients.call(add, "[1, 2]")
        assert bad.error is not None and "not a JSON object" in bad.text
    finally:
        await clients.close()


async def test_a_slow_call_times_out_and_the_session_goes_on() -> None:
    clients = McpClients((calc_server(),), timeout_s=0.5)
    await clients.connect()
    try:
        started = time.monotonic()
        result = await clients.call(clients.find("calc__sleep"), '{"seconds": 30}')
        assert time.monotonic() - started < 5
        assert result.error is not None and result.error["code"] == -32001
        assert result.text == "Error: the tool timed out after 0.5 s"
        assert (await clients.call(clients.find("calc__add"), '{"a": 1, "b": 1}')).text == "2"
    finally:
        await clients.close()


async def test_long_output_is_cut_and_says_so() -> None:
    clients = McpClients((calc_server(),), max_output_bytes=64 * 1024)
    await clients.connect()
    try:
        big = clients.find("calc__big")
        result = await clients.call(big, '{"size": 100000}')
        head, note = result.text.rsplit("\n", 1)
        assert head == "x" * 64 * 1024
        assert note == "[output truncated: 100000 bytes, limit 65536]"
        assert (await clients.call(big, '{"size": 1000}')).text == "x" * 1000
    finally:
        await clients.close()


async def test_a_server_gets_a_minimal_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCP_TEST_SECRET", "from-the-parent")
    clients = McpClients((calc_server(MCP_TEST_GIVEN="from-the-config"),))
    await clients.connect()
    try:
        env = clients.find("calc__env")
        assert (await clients.call(env, '{"name": "MCP_TEST_SECRET"}')).text == "<unset>"
        given = await clients.call(env, '{"name": "MCP_TEST_GIVEN"}')
        assert given.text == "from-the-config"
        assert (await clients.call(env, '{"name": "PATH"}')).text == os.environ["PATH"]
    finally:
        await clients.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def http_server() -> Iterator[str]:
    """The calc server over streamable HTTP; its URL once it answers."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, str(CALC_SCRIPT), "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, "no HTTP server"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_a_streamable_http_server(http_server: str) -> None:
    server = McpServerConfig("remote", url=http_server, headers={"X-Test": "1"})
    clients = McpClients((server,))
    await clients.connect()
    try:
        add = clients.find("remote__add")
        assert add is not None
        assert (await clients.call(add, '{"a": 20, "b": 22}')).text == "42"
    finally:
        await clients.close()


@pytest.mark.parametrize(
    ("server", "needle"),
    [
        (McpServerConfig("gone", command="/no/such/mcp-server"), "could not be connected"),
        (McpServerConfig("quits", command=sys.executable, args=("-c", "pass")), "'quits'"),
        (McpServerConfig("nohttp", url="http://127.0.0.1:9/mcp"), "'nohttp'"),
    ],
)
async def test_a_server_that_cannot_connect_is_a_one_line_error(
    server: McpServerConfig, needle: str
) -> None:
    clients = McpClients((calc_server(), server))
    with pytest.raises(McpStartupError) as caught:
        await clients.connect()
    message = str(caught.value)
    assert needle in message and "\n" not in message
    assert clients.startup_error is caught.value
    assert clients.tools == () and clients.find("calc__add") is None


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("{", "not valid JSON"),
        ('{"servers": {}}', "mcpServers"),
        ('{"mcpServers": {"a b": {"command": "x"}}}', "'a b'"),
        ('{"mcpServers": {"a": {"command": "x", "url": "http://h"}}}', "unknown keys"),
        ('{"mcpServers": {"a": {}}}', "either a command or a url"),
        ('{"mcpServers": {"a": {"command": "x", "args": "y"}}}', "list of strings"),
        ('{"mcpServers": {"a": {"command": "x", "env": {"K": 1}}}}', "object of strings"),
        ('{"mcpServers": {"a": {"url": "ftp://h"}}}', "http://"),
        ('{"mcpServers": {"a": {"url": "http://h", "type": "sse"}}}', "not supported"),
    ],
)
def test_a_bad_config_file_names_the_problem(tmp_path: Path, config: str, needle: str) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(config)
    with pytest.raises(ValueError, match=None) as caught:
        load_mcp_config(str(path))
    assert needle in str(caught.value)


def test_a_config_file_with_both_kinds(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    servers = {
        "calc": {"command": "python3", "args": ["s.py"], "env": {"K": "v"}, "type": "stdio"},
        "web": {"url": "https://example.test/mcp", "headers": {"Authorization": "Bearer t"}},
    }
    path.write_text(json.dumps({"mcpServers": servers}))
    calc, web = load_mcp_config(str(path))
    assert (calc.command, calc.args, calc.env) == ("python3", ("s.py",), {"K": "v"})
    assert (web.url, web.headers) == ("https://example.test/mcp", {"Authorization": "Bearer t"})


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_llm_runtime.api.cli.serve",
            "--mock-engine",
            "--port",
            "0",
            *args,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_runtime_serve_stops_with_one_line_when_a_server_cannot_start(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"gone": {"command": "/no/such/mcp-server"}}}))
    result = _serve("--mcp-config", str(path), "--log", str(tmp_path / "server.log"))
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("runtime-serve: error: MCP server 'gone'")


def test_runtime_serve_refuses_a_bad_config_file_as_a_flag_error(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": []}')
    result = _serve("--mcp-config", str(path))
    assert result.returncode == 2
    assert result.stderr.startswith("runtime-serve: error: the MCP config")
    assert len(result.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- chat completions


@pytest.fixture(scope="module")
def chat_server() -> Iterator[tuple[str, MockEngine]]:
    engine = MockEngine(max_model_len=16384, token_delay_s=0)
    config = ServerConfig(tool_parser="hermes", mcp_servers=(calc_server(),))
    with serve_in_thread(create_app(engine, config=config)) as url:
        yield url, engine


def _chat(url: str, **fields: Any) -> dict[str, Any]:
    response = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": ASK, **fields}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def _last_prompt(engine: MockEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)


def test_chat_requests_without_tools_get_the_mcp_tools(chat_server: tuple[str, MockEngine]) -> None:
    url, engine = chat_server
    _chat(url)
    prompt = _last_prompt(engine)
    assert '"name": "calc__add"' in prompt and '"name": "calc__web_search"' in prompt


def test_an_empty_tools_list_opts_out(chat_server: tuple[str, MockEngine]) -> None:
    url, engine = chat_server
    assert _chat(url, tools=[])["choices"][0]["message"]["content"] == "?3 + 2 si tahW"
    assert "calc__" not in _last_prompt(engine)


def test_a_request_with_its_own_tools_gets_only_those(chat_server: tuple[str, MockEngine]) -> None:
    url, engine = chat_server
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    _chat(url, tools=[weather])
    prompt = _last_prompt(engine)
    assert '"name": "get_weather"' in prompt and "calc__" not in prompt


def test_chat_returns_mcp_calls_without_running_them(
    chat_server: tuple[str, MockEngine], tmp_path: Path
) -> None:
    url, engine = chat_server
    marker = tmp_path / "ran"
    engine.replies.append(hermes_call("calc__touch", path=str(marker)))
    choice = _chat(url)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "calc__touch"
    assert json.loads(call["function"]["arguments"]) == {"path": str(marker)}
    assert not marker.exists()
