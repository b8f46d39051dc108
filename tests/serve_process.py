"""Run ``runtime-serve`` as a subprocess for end-to-end tests."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVING_LINE = re.compile(r"Serving (?P<model>\S+) on (?P<url>http://\S+/v1)")


@dataclass
class ServerProcess:
    url: str  # ".../v1"
    model: str
    log: Path
    pid: int = 0
    returncode: int | None = None  # set once the server has been stopped


def serve_command() -> list[str]:
    """The installed console script when present (it is after `just setup`), else the module."""
    script = Path(sys.executable).with_name("runtime-serve")
    return (
        [str(script)]
        if script.exists()
        else [sys.executable, "-m", "jax_llm_runtime.api.cli.serve"]
    )


@contextmanager
def launched_server(
    args: list[str], log: Path
) -> Iterator[tuple[subprocess.Popen[str], ServerProcess]]:
    """Start the server on a free port and wait for its ready line; the process is killed after
    the block if it is still running (the caller stops it as the test needs)."""
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [*serve_command(), "--port", "0", *args],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once warmup is done and the socket listens
        match = SERVING_LINE.search(line)
        assert match, f"unexpected first line {line!r}; log:\n{log.read_text()[-3000:]}"
        yield proc, ServerProcess(match["url"], match["model"], log, pid=proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def running_server(args: list[str], log: Path, stop_timeout: float = 30) -> Iterator[ServerProcess]:
    """``launched_server``, stopped with Ctrl-C (SIGINT) after the block.

    After the block, ``returncode`` holds the exit status and the log has the server's stderr.
    """
    with launched_server(args, log) as (proc, server):
        try:
            yield server
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=stop_timeout)
            finally:
                proc.kill()
            server.returncode = proc.returncode
