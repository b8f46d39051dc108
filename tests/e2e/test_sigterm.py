"""SIGTERM to a real ``runtime-serve`` process: it stops admitting (new requests and /health get
503 while the socket stays open), lets running requests finish within ``--shutdown-timeout`` or
ends them with an error past it, and exits with status 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.serve_process import launched_server

pytestmark = pytest.mark.e2e


@contextmanager
def server(args: list[str], log: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``runtime-serve --port 0 ARGS``, once ready: (process, base URL without /v1)."""
    with launched_server(args, log) as (proc, started):
        yield proc, started.url.removesuffix("/v1")


@dataclass
class Streamed:
    """One streamed completion read on a thread: ``started`` is set at its first event."""

    events: list[dict] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    started: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, Streamed]:
    out = Streamed()

    def read() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        out.done = True
                    else:
                        out.events.append(json.loads(line[len("data: ") :]))
                    out.started.set()
        except BaseException as exc:  # reported by the test's assertions
            out.error = exc
            out.started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, out


def post_in_thread(url: str, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    result: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: result.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60)),
        daemon=True,
    )
    thread.start()
    return thread, result


def assert_503(response: httpx.Response, code: str) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == code


def finish_reasons(out: Streamed) -> list[str | None]:
    return [e["choices"][0]["finish_reason"] for e in out.events if e.get("choices")]


def test_sigterm_drains_running_requests_then_exits_0(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    # 1500 tokens at ~1 ms each: the stream is still running when the signal arrives.
    body = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with server(["--mock-engine", "--shutdown-timeout", "30"], log) as (proc, url):
        thread, out = stream_in_thread(url, body)
        assert out.started.wait(10) and out.error is None
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the drain starts on the server's next tick (0.1 s)
        assert_503(httpx.get(f"{url}/health", timeout=5), "server_shutting_down")
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=5)
        assert_503(refused, "server_shutting_down")
        assert refused.headers["retry-after"] == "1"
        thread.join(30)
        assert proc.wait(timeout=30) == 0
    assert out.error is None and out.done
    assert finish_reasons(out)[-1] == "length"
    assert sum(len(e["choices"][0]["text"]) for e in out.events if e.get("choices")) == 1500
    text = log.read_text()
    assert "draining" in text and "drained" in text
    assert "Traceback" not in text


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    args = ["--mock-engine", "--shutdown-timeout", "1", "--max-model-len", "65536"]
    long = {"prompt": "hi", "max_tokens": 60000, "ignore_eos": True}  # about a minute
    with server(args, log) as (proc, url):
        stream_thread, out = stream_in_thread(url, {**long, "stream": True})
        post_thread, posted = post_in_thread(url, long)
        assert out.started.wait(10) and out.error is None
        time.sleep(0.2)  # the JSON request is generating too
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        elapsed = time.monotonic() - t0
        stream_thread.join(5)
        post_thread.join(5)
    assert 1 <= elapsed < 15, elapsed  # far below the minute the requests would take
    assert out.error is None and out.done  # the stream was closed properly, with [DONE]
    assert out.events[-1]["error"]["code"] == "engine_aborted"
    assert set(finish_reasons(out)) == {None}
    assert_503(posted[0], "engine_aborted")
    text = log.read_text()
    assert "shutdown timeout: aborting" in text
    assert "Traceback" not in text


def test_sigterm_when_idle_exits_0_at_once(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with server(["--mock-engine"], log) as (proc, url):
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    assert time.monotonic() - t0 < 5
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
def test_sigterm_drains_the_default_model(smollm2_gguf: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    args = ["--max-model-len", "512", "--max-num-seqs", "2", "--shutdown-timeout", "60"]
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with server(args, log) as (proc, url):
        thread, out = stream_in_thread(url, body)
        assert out.started.wait(60) and out.error is None
        proc.send_signal(signal.SIGTERM)
        thread.join(60)
        assert proc.wait(timeout=60) == 0
    assert out.error is None and out.done
    assert finish_reasons(out)[-1] == "length"
    assert "Traceback" not in log.read_text()
