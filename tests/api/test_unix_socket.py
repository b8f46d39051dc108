"""``runtime-serve --h unix:///path`` (candle-vllm's spelling): the whole API on a unix domain
socket, served by a real ``runtime-serve`` process on the mock engine."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from jax_llm_runtime.api.cli.serve import _checked_flags, build_parser
from jax_llm_runtime.api.cli.unix_socket import UnixSocketError, bind_unix_socket
from tests.serve_process import REPO_ROOT

READY_LINE = re.compile(r"Serving (?P<model>\S+) on unix://(?P<path>\S+) \(ready in ")
WARNING = "runtime-serve: warning: "


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder with a short path: a socket's path must fit in about 100 bytes, more than
    pytest's tmp_path may leave."""
    folder = Path("/tmp") / f"uds-{os.getpid()}"
    folder.mkdir()
    try:
        yield folder
    finally:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "jax_llm_runtime.api.cli.serve", "--mock-engine", *args]


@contextmanager
def _server(log: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A server started with ``args``, once its ready line is out: the process and the model's
    name. Killed after the block if still running."""
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            _command(*args), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = READY_LINE.search(line)
        assert match, f"unexpected first line {line!r}; log:\n{log.read_text()[-3000:]}"
        yield proc, match["model"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.e2e
def test_the_api_is_served_on_a_unix_socket_and_removed_at_ctrl_c(short_tmp: Path) -> None:
    path = short_tmp / "s.sock"
    log = short_tmp / "server.log"
    with _server(log, "--h", f"unix://{path}") as (proc, model):
        assert stat.S_ISSOCK(path.stat().st_mode)
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~umask
        transport = httpx.HTTPTransport(uds=str(path))
        with httpx.Client(transport=transport, base_url="http://localhost/v1") as http:
            models = http.get("/models")
            assert models.status_code == 200
            assert [m["id"] for m in models.json()["data"]] == [model]
            client = openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=http)
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8
            )
            assert reply.choices[0].message.content
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    assert not path.exists()
    assert WARNING not in log.read_text()


@pytest.mark.e2e
def test_a_stale_socket_is_replaced_and_sigterm_removes_it(short_tmp: Path) -> None:
    path = short_tmp / "s.sock"
    killed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    killed.bind(str(path))  # what a killed server leaves: a socket file nobody accepts on
    killed.close()
    with _server(short_tmp / "server.log", "--h", f"socket://{path}", "--p", "8000") as (proc, _):
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as http:
            assert http.get("http://localhost/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    (line,) = [
        line for line in (short_tmp / "server.log").read_text().splitlines() if WARNING in line
    ]
    assert line == f"{WARNING}--port 8000 ignored: the API is served on unix://{path}"
    assert not path.exists()


def test_a_regular_file_at_the_path_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("mine\n")
    result = subprocess.run(
        _command("--h", f"file://{path}"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("runtime-serve: error: ") and "is not a socket" in line
    assert path.read_text() == "mine\n"


@pytest.mark.parametrize(
    ("host", "needle"),
    [
        ("unix://{tmp}/no/such/folder/s.sock", "does not exist"),
        ("unix://", "expected unix:///path"),
    ],
)
def test_a_path_that_cannot_be_served_is_one_error_line(
    host: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    args = parser.parse_args(["--mock-engine", "--h", host.format(tmp=tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        _checked_flags(parser, args)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("runtime-serve: error: ") and needle in line, line


def test_a_live_server_keeps_its_socket(
    short_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = short_tmp / "s.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen()
    try:
        parser = build_parser()
        with pytest.raises(SystemExit):
            _checked_flags(parser, parser.parse_args(shlex.split(f"--h unix://{path}")))
        assert "another server is listening on it" in capsys.readouterr().err
        with pytest.raises(UnixSocketError, match="another server is listening on it"):
            bind_unix_socket(str(path))
        assert stat.S_ISSOCK(path.stat().st_mode)
    finally:
        live.close()


def test_ui_port_on_a_unix_socket_serves_the_ui_on_the_socket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    args = parser.parse_args(shlex.split(f"--h unix://{tmp_path}/s.sock --ui-port 3000"))
    _checked_flags(parser, args)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{WARNING}--ui-port 3000 ignored: ")
    assert (args.ui_port, args.ui_server) == (None, "1")  # the UI at / of the socket


def test_multi_node_followers_do_not_check_the_leaders_socket_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    command = "--m x --num-nodes 2 --node-rank 1 --coordinator-address h:1 --h unix:///no/s.sock"
    args = parser.parse_args(shlex.split(command))
    _checked_flags(parser, args)
    assert args.uds == "/no/s.sock"
    assert capsys.readouterr().err == ""
