"""``runtime-chat`` against the app on the mock engine, driven through stdin like a user would.

The server runs in this process (uvicorn on a thread) so the tests can read what the mock engine
was asked; the client runs as a real subprocess (the installed console script when present).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.cli.chat_client import REASONING_LABEL, ChatError, ReplyRenderer, sse_data
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.inprocess import serve_in_thread
from tests.serve_process import REPO_ROOT

THINK = ("<think>", "</think>")


def chat_command() -> list[str]:
    script = Path(sys.executable).with_name("runtime-chat")
    return (
        [str(script)]
        if script.exists()
        else [sys.executable, "-m", "jax_llm_runtime.api.cli.chat_client"]
    )


def client_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RUNTIME_API_KEY", "NO_COLOR")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return {**env, **extra}


def run_chat(
    url: str, stdin: str, *args: str, cwd: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*chat_command(), "--url", url, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=client_env(**env),
        timeout=60,
        check=False,
    )


@pytest.fixture
def mock() -> MockEngine:
    engine = MockEngine(model_name="mock-model", max_model_len=1024)
    engine.tokenizer.reasoning_markers = THINK
    return engine


@pytest.fixture
def url(mock: MockEngine) -> Iterator[str]:
    with serve_in_thread(create_app(mock)) as base:
        yield f"{base}/v1"


def prompts(mock: MockEngine) -> list[str]:
    return [mock.tokenizer.decode(r.prompt_token_ids) for r in mock.requests]


def test_two_turns_keep_history_and_show_reasoning_apart(
    mock: MockEngine, url: str, tmp_path: Path
) -> None:
    mock.replies.extend(["<think>pondering it</think>First answer.", "Second answer."])
    args = ("--system", "Be brief.", "--max-tokens", "64", "--temperature", "0", "--top-k", "5")
    result = run_chat(url, "hello there\nand again\n", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("Chatting with mock-model at ")  # the first of /v1/models
    lines = out.splitlines()
    assert f"> {REASONING_LABEL}pondering it" in lines  # reasoning on a line of its own
    assert "First answer." in lines and "> Second answer." in lines
    assert "\x1b[" not in out  # not a terminal: no colour codes

    assert len(mock.requests) == 2
    first, second = prompts(mock)
    assert first.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    # The second turn carries the whole history: system, both user turns, the first reply's
    # content (not its reasoning).
    assert second == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhello there<|im_end|>\n"
        "<|im_start|>assistant\nFirst answer.<|im_end|>\n"
        "<|im_start|>user\nand again<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    sampling = mock.requests[0].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_k) == (64, 0.0, 5)


def test_candle_vllm_chat_py_flags(mock: MockEngine, url: str, tmp_path: Path) -> None:
    """candle-vllm's examples/chat.py command line runs as it is: its underscore spellings, its
    --thinking true/false and its display flags (accepted; replies always stream)."""
    mock.replies.append("Hi.")
    port = url.rsplit(":", 1)[1].split("/")[0]
    args = (
        "--port", port, "--system_prompt", "Be brief.", "--max_tokens", "32", "--top_p", "0.9",
        "--top_k", "7", "--min_p", "0.05", "--frequency_penalty", "0.5",
        "--presence_penalty", "0.25", "--repeat_last_n", "16", "--thinking", "false",
        "--stream", "--live", "--frequency", "10", "--context_cache", "true",
    )  # fmt: skip
    result = subprocess.run(
        [*chat_command(), *args],
        input="hello\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=client_env(),
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"at http://localhost:{port}/v1" in result.stdout and "Hi." in result.stdout
    [request] = mock.requests
    assert prompts(mock)[0].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    s = request.sampling
    assert (s.max_tokens, s.top_p, s.top_k, s.min_p) == (32, 0.9, 7, 0.05)
    assert (s.frequency_penalty, s.presence_penalty, s.repeat_last_n) == (0.5, 0.25, 16)
    bad = run_chat(url, "", "--thinking", "maybe", cwd=tmp_path)
    assert bad.returncode == 2 and "expected true or false" in bad.stderr


def test_reset_and_exit_commands(mock: MockEngine, url: str, tmp_path: Path) -> None:
    result = run_chat(url, "one\n/reset\ntwo\n/exit\nnever sent\n", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[history cleared]" in result.stdout
    assert "> eno" in result.stdout and "> owt" in result.stdout  # the mock reverses
    assert len(mock.requests) == 2
    assert "one" not in prompts(mock)[1]


def test_server_errors_are_shown_and_the_turn_is_dropped(
    mock: MockEngine, url: str, tmp_path: Path
) -> None:
    result = run_chat(url, "x" * 1100 + "\nshort\n", cwd=tmp_path)  # over max_model_len
    assert result.returncode == 0, result.stderr
    assert "[error: HTTP 400: " in result.stdout and "maximum context length" in result.stdout
    assert "> trohs" in result.stdout
    assert prompts(mock)[-1] == "<|im_start|>user\nshort<|im_end|>\n<|im_start|>assistant\n"


def test_ctrl_c_stops_the_reply_and_starts_a_new_chat(
    mock: MockEngine, url: str, tmp_path: Path
) -> None:
    mock.replies.extend(["first turn answer", "z" * 3000])
    mock.token_delay_s = 0.005
    proc = subprocess.Popen(
        [*chat_command(), "--url", url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=client_env(),
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(lambda: proc.stdout.read(1), "")))
    reader.start()

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + 30
        while text not in "".join(output):
            assert time.monotonic() < deadline, f"no {text!r} in {''.join(output)!r}"
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.01)

    try:
        assert proc.stdin is not None
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        wait_for("first turn answer")
        proc.stdin.write("tell me more\n")
        proc.stdin.flush()
        wait_for("zzzzz")  # the long reply is streaming
        proc.send_signal(signal.SIGINT)
        wait_for("[reply stopped; starting a new chat]")
        assert mock.wait_for_aborts(1, timeout_s=30)  # closing the stream aborted the request
        proc.stdin.write("fresh start\n")
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        proc.kill()
        reader.join(timeout=10)
    assert "".join(output).count("z") < 3000
    assert len(mock.requests) == 3
    assert prompts(mock)[2] == "<|im_start|>user\nfresh start<|im_end|>\n<|im_start|>assistant\n"


def test_api_key_from_dotenv_and_the_environment_wins(tmp_path: Path) -> None:
    app = create_app(MockEngine(model_name="mock-model"), config=ServerConfig(api_key="sekret"))
    with serve_in_thread(app) as base:
        url = f"{base}/v1"
        refused = run_chat(url, "hi\n", cwd=tmp_path)
        assert refused.returncode == 1 and refused.stdout == ""
        assert refused.stderr.startswith(f"runtime-chat: error: {url}: GET /models: HTTP 401")
        (tmp_path / ".env").write_text("RUNTIME_API_KEY=sekret\n")
        accepted = run_chat(url, "hi\n", cwd=tmp_path)
        assert accepted.returncode == 0 and "> ih" in accepted.stdout, accepted.stderr
        overridden = run_chat(url, "hi\n", cwd=tmp_path, RUNTIME_API_KEY="wrong")
        assert overridden.returncode == 1 and "HTTP 401" in overridden.stderr


def test_an_unreachable_server_is_one_line_exit_1(tmp_path: Path) -> None:
    result = run_chat("http://127.0.0.1:9/v1", "hi\n", cwd=tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("runtime-chat: error: http://127.0.0.1:9/v1: ")
    assert result.stderr.count("\n") == 1


def test_renderer_dims_reasoning_on_a_terminal() -> None:
    out = io.StringIO()
    renderer = ReplyRenderer(out, color=True)
    for piece in ("Let me ", "think."):
        renderer.reasoning(piece)
    renderer.content("")
    renderer.content("The answer.")
    renderer.end()
    assert out.getvalue() == (
        f"\x1b[2m{REASONING_LABEL}Let me \x1b[0m\x1b[2mthink.\x1b[0m\nThe answer.\x1b[0m\n"
    )


def test_renderer_without_colour_prefixes_reasoning_only() -> None:
    out = io.StringIO()
    renderer = ReplyRenderer(out, color=False)
    renderer.content("Plain reply.")
    renderer.end()
    assert out.getvalue() == "Plain reply.\n"
    out = io.StringIO()
    renderer = ReplyRenderer(out, color=False)
    renderer.reasoning("hmm")
    renderer.content("ok")
    renderer.end()
    assert out.getvalue() == f"{REASONING_LABEL}hmm\nok\n"


def test_sse_parsing_stops_at_done_and_raises_error_events() -> None:
    lines = [": comment", 'data: {"a": 1}', "", "event: x", 'data:{"b": 2}', "data: [DONE]"]
    assert list(sse_data([*lines, 'data: {"after": 1}'])) == [{"a": 1}, {"b": 2}]
    with pytest.raises(ChatError, match="engine stopped"):
        list(sse_data(['data: {"error": {"message": "the engine stopped"}}']))
