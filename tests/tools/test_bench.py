"""tools/bench.py against a tiny fake OpenAI streaming server (no model, well under 5 s)."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

BENCH_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench.py"
CONTENT_CHUNKS = 5  # one token per chunk
TIMINGS_TOKENS = 7  # differs from CONTENT_CHUNKS so the test sees which count was used


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_under_test", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # the default 5 drops connections when many workers connect at once

    def __init__(self, token_report: str) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.token_report = token_report  # "usage" | "timings" | "none"
        self.bodies: list[dict] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        payload = json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self._event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(CONTENT_CHUNKS):
            time.sleep(0.002)
            self._event({"choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]})
        final: dict = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        if self.server.token_report == "timings":
            final["timings"] = {"predicted_n": TIMINGS_TOKENS, "prompt_n": 3}
        self._event(final)
        if self.server.token_report == "usage":
            usage = {"prompt_tokens": 3, "completion_tokens": CONTENT_CHUNKS, "total_tokens": 8}
            self._event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, chunk: dict) -> None:
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()


def _serve(token_report: str) -> Iterator[FakeServer]:
    server = FakeServer(token_report)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def usage_server() -> Iterator[FakeServer]:
    yield from _serve("usage")


@pytest.fixture
def timings_server() -> Iterator[FakeServer]:
    yield from _serve("timings")


@pytest.fixture
def plain_server() -> Iterator[FakeServer]:
    yield from _serve("none")


def _check_level(level: dict, concurrency: int, requests: int, tokens_each: int) -> None:
    assert level["concurrency"] == concurrency
    assert level["requests"] == requests
    assert level["failed"] == 0
    assert level["output_tokens"] == requests * tokens_each
    assert level["wall_s"] > 0
    assert level["output_tok_per_s"] > 0
    assert level["output_tok_per_s"] == pytest.approx(level["output_tokens"] / level["wall_s"])
    assert 0 < level["ttft_p50_s"] <= level["ttft_p90_s"]
    assert 0 < level["ttft_mean_s"] < level["e2e_mean_s"]
    assert level["tpot_mean_s"] > 0


def test_usage_and_peer_with_timings(usage_server, timings_server, tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--base-url", usage_server.base_url, "--peer-url", timings_server.base_url]
    argv += ["--concurrency", "1,2", "--num-requests", "4", "--max-tokens", "16"]
    assert bench.main([*argv, "--json", str(out)]) == 0

    report = json.loads(out.read_text())
    ours, peer = report["servers"]
    assert (ours["name"], ours["model"], peer["name"]) == ("ours", "fake-model", "peer")
    for i, conc in enumerate((1, 2)):
        _check_level(ours["levels"][i], conc, 4, CONTENT_CHUNKS)
        _check_level(peer["levels"][i], conc, 4, TIMINGS_TOKENS)
        assert ours["levels"][i]["token_sources"] == ["usage"]
        assert peer["levels"][i]["token_sources"] == ["timings"]
        ratio = report["ratios_ours_over_peer"][i]
        expected = ours["levels"][i]["output_tok_per_s"] / peer["levels"][i]["output_tok_per_s"]
        assert ratio["output_tok_per_s"] == pytest.approx(expected)

    # 1 warm-up + 4 + 4 measured requests per server, all as the benchmark promises.
    assert len(usage_server.bodies) == len(timings_server.bodies) == 9
    measured = usage_server.bodies[1:]
    assert all(b["stream"] and b["temperature"] == 0 and b["max_tokens"] == 16 for b in measured)
    assert all(b["stream_options"] == {"include_usage": True} for b in measured)
    assert not any("ignore_eos" in b for b in usage_server.bodies)
    prompts = [b["messages"][-1]["content"] for b in usage_server.bodies + timings_server.bodies]
    assert len(set(prompts)) == len(prompts), "every request must miss the prefix cache"

    printed = capsys.readouterr().out
    assert sum(line.startswith("ours/peer ") for line in printed.splitlines()) == 2
    first = ours["levels"][0]
    row = next(line for line in printed.splitlines() if line.startswith("ours "))
    assert row.split()[1:5] == ["1", "4", "0", str(first["output_tokens"])]
    assert f"{first['output_tok_per_s']:.2f}" in row


def test_counts_chunks_without_usage(plain_server, tmp_path, capsys):
    out = tmp_path / "plain.json"
    argv = ["--base-url", plain_server.base_url, "--model", "given-model"]
    argv += ["--concurrency", "2", "--num-requests", "3", "--json", str(out)]
    assert bench.main(argv) == 0

    (server,) = json.loads(out.read_text())["servers"]
    assert server["model"] == "given-model"
    _check_level(server["levels"][0], 2, 3, CONTENT_CHUNKS)
    assert server["levels"][0]["token_sources"] == ["chunks"]
    assert "counted as content chunks" in capsys.readouterr().out


def test_percentile_matches_linear_interpolation():
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert bench.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert bench.percentile([7.0], 90) == 7.0
