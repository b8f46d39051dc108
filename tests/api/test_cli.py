"""``runtime-serve`` (``python -m api.cli.serve``): flag errors, and an end-to-end run with the openai SDK."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from jax_llm_runtime.api.cli.serve import build_parser
from tests.serve_process import REPO_ROOT, running_server


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jax_llm_runtime.api.cli.serve", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "abc"], "--port"),
        (["--port", "70000"], "--port"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--dtype", "int3"], "--dtype"),
        (["--page-size", "3"], "page_size"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_flags_print_one_line_and_exit_2(args: list[str], needle: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("runtime-serve: error: ") and needle in lines[0]


def test_flag_aliases_parse() -> None:
    args = build_parser().parse_args(["--m", "x", "--f", "w.gguf", "--p", "1", "--mem", "64"])
    assert (args.model_id, args.weight_file, args.port, args.kvcache_mem_mb) == (
        "x",
        "w.gguf",
        1,
        64,
    )


def test_model_source_error_is_one_line_exit_1() -> None:
    result = run_cli("--model-id", "/no/such/model/dir", "--log", os.devnull)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("runtime-serve: error: "), result.stderr


def test_a_device_that_is_not_there_is_one_line_exit_1() -> None:
    # Apple's Metal plugin never loads on Linux, whatever accelerators the machine has.
    result = run_cli("--device", "metal", "--mock-engine", "--log", os.devnull)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("runtime-serve: error: device 'metal' is not available; JAX can use: ")
    assert "cpu" in line


@pytest.fixture
def mock_server(tmp_path: Path) -> Iterator[str]:
    """``runtime-serve --mock-engine``; yields its base URL (``.../v1``).

    Stopped with Ctrl-C (SIGINT), which must shut down cleanly: status 130, no traceback.
    """
    log = tmp_path / "server.log"
    with running_server(["--mock-engine", "--served-model-name", "mock"], log, 15) as server:
        assert server.model == "mock"
        yield server.url
    assert server.returncode == 130, log.read_text()
    assert "Traceback" not in log.read_text()
    assert "shutting down engine" in log.read_text()


@pytest.mark.e2e
def test_openai_sdk_against_mock_server(mock_server: str) -> None:
    client = openai.OpenAI(base_url=mock_server, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["mock"]

    reply = client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hello"}], max_tokens=20
    )
    assert reply.choices[0].message.content == "olleh"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 6

    stream = client.chat.completions.create(
        model="mock",
        messages=[{"role": "user", "content": "stream me"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "em maerts"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10

    completion = client.completions.create(model="mock", prompt="abc", max_tokens=2)
    assert completion.choices[0].text == "cb"
    assert completion.choices[0].finish_reason == "length"

    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model="mock", messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert excinfo.value.status_code == 400
    assert excinfo.value.param == "temperature"
    assert excinfo.value.type == "invalid_request_error"

    # candle-vllm's clients send any name: the one served model answers and reports its own.
    other = client.chat.completions.create(
        model="gpt-4", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert other.model == "mock"


@pytest.mark.e2e
def test_concurrent_requests_against_mock_server(mock_server: str) -> None:
    async def both() -> list[str]:
        client = openai.AsyncOpenAI(base_url=mock_server, api_key="unused", max_retries=0)

        async def ask(text: str) -> str:
            stream = await client.chat.completions.create(
                model="mock", messages=[{"role": "user", "content": text}], stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            return await asyncio.gather(ask("first request"), ask("second one"))
        finally:
            await client.close()

    assert asyncio.run(both()) == ["tseuqer tsrif", "eno dnoces"]
