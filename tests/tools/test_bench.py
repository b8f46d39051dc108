"""tools/bench.py (and its reporting half, tools/bench_report.py) against a tiny fake OpenAI
streaming server (no model, a few seconds)."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.tools import load_tool

CONTENT_CHUNKS = 5  # one token per chunk; the fake "EOS" comes after this many
TIMINGS_TOKENS = 7  # differs from CONTENT_CHUNKS so the test sees which count was used


bench = load_tool("bench.py")
report = load_tool("bench_report.py")


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # the default 5 drops connections when many workers connect at once

    def __init__(self, token_report: str) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.token_report = token_report  # "usage" | "timings" | "none"
        self.bodies: list[dict] = []
        self.paths: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


def _prompt_text(body: dict) -> str:
    return body["messages"][-1]["content"] if "messages" in body else body["prompt"]


class FakeHandler(BaseHTTPRequestHandler):
    """Streams one token per chunk; its tokenizer is whitespace words, its EOS comes after
    CONTENT_CHUNKS tokens unless the request sets ignore_eos."""

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
        self.server.paths.append(self.path)
        chat = self.path.endswith("/chat/completions")
        n_out = body["max_tokens"] if body.get("ignore_eos") else CONTENT_CHUNKS
        n_out = min(n_out, body["max_tokens"])
        n_in = len(_prompt_text(body).split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(n_out):
            time.sleep(0.002)
            piece = {"delta": {"content": f"tok{i} "}} if chat else {"text": f"tok{i} "}
            self._event({"choices": [{"index": 0, **piece}]})
        final: dict = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        if self.server.token_report == "timings":
            predicted = n_out if body.get("ignore_eos") else TIMINGS_TOKENS
            final["timings"] = {"predicted_n": predicted, "prompt_n": n_in - 1, "cache_n": 1}
        self._event(final)
        if self.server.token_report == "usage":
            usage = {"prompt_tokens": n_in, "completion_tokens": n_out}
            self._event({"choices": [], "usage": {**usage, "total_tokens": n_in + n_out}})
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
    assert level["request_per_s"] == pytest.approx(requests / level["wall_s"])
    assert 0 < level["ttft_p50_s"] <= level["ttft_p90_s"] <= level["ttft_p99_s"]
    assert 0 < level["ttft_mean_s"] < level["e2e_mean_s"]
    assert level["tpot_mean_s"] > 0
    assert 0 < level["tpot_p50_s"] <= level["tpot_p90_s"]
    assert 0 < level["itl_p50_s"] <= level["itl_p90_s"] <= level["itl_p99_s"]
    assert level["itl_mean_s"] > 0
    assert 0 < level["e2e_p50_s"] <= level["e2e_p90_s"]


def _prompt_bodies(server: FakeServer) -> list[str]:
    """Measured prompts without their leading run tag."""
    return [_prompt_text(b).split("] ", 1)[1] for b in server.bodies[1:]]


def test_usage_and_peer_with_timings(usage_server, timings_server, tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--base-url", usage_server.base_url, "--peer-url", timings_server.base_url]
    argv += ["--concurrency", "1,2", "--num-requests", "4", "--max-tokens", "16"]
    assert bench.main([*argv, "--json", str(out)]) == 0

    report = json.loads(out.read_text())
    assert report["config"]["max_tokens"] == report["config"]["output_len"] == 16
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
        expected = ours["levels"][i]["itl_p50_s"] / peer["levels"][i]["itl_p50_s"]
        assert ratio["itl_p50_s"] == pytest.approx(expected)
        # Same fixed prompts on both servers; usage and prompt_n + cache_n agree on their length.
        in_ours, in_peer = (
            ours["levels"][i]["input_tokens_mean"],
            peer["levels"][i]["input_tokens_mean"],
        )
        assert in_ours == pytest.approx(in_peer)
        assert 10 < in_ours < 25

    # 1 warm-up + 4 + 4 measured requests per server, all as the benchmark promises.
    assert len(usage_server.bodies) == len(timings_server.bodies) == 9
    assert set(usage_server.paths) == {"/v1/chat/completions"}
    measured = usage_server.bodies[1:]
    assert all(b["stream"] and b["temperature"] == 0 and b["max_tokens"] == 16 for b in measured)
    assert all(b["stream_options"] == {"include_usage": True} for b in measured)
    assert not any("ignore_eos" in b or "min_tokens" in b for b in usage_server.bodies)
    prompts = [_prompt_text(b) for b in usage_server.bodies + timings_server.bodies]
    assert len(set(prompts)) == len(prompts), "every request must miss the prefix cache"

    printed = capsys.readouterr().out
    # Two tables, each with a ratio row per level.
    assert sum(line.startswith("ours/peer ") for line in printed.splitlines()) == 4
    first = ours["levels"][0]
    row = next(line for line in printed.splitlines() if line.startswith("ours "))
    assert row.split()[1:5] == ["1", "4", "0", str(first["output_tokens"])]
    assert f"{first['output_tok_per_s']:.2f}" in row
    assert "below --output-len 16 (pass --exact-output" in printed


def test_counts_chunks_without_usage(plain_server, tmp_path, capsys):
    out = tmp_path / "plain.json"
    argv = ["--base-url", plain_server.base_url, "--model", "given-model"]
    argv += ["--concurrency", "2", "--num-requests", "3", "--json", str(out)]
    assert bench.main(argv) == 0

    (server,) = json.loads(out.read_text())["servers"]
    assert server["model"] == "given-model"
    _check_level(server["levels"][0], 2, 3, CONTENT_CHUNKS)
    assert server["levels"][0]["token_sources"] == ["chunks"]
    assert server["levels"][0]["input_tokens_mean"] is None
    assert "counted as content chunks" in capsys.readouterr().out


def test_completions_random_prompts_exact_output(usage_server, timings_server, tmp_path, capsys):
    out = tmp_path / "completions.json"
    argv = ["--base-url", usage_server.base_url, "--peer-url", timings_server.base_url]
    argv += ["--endpoint", "completions", "--prompts", "random", "--input-len", "64"]
    argv += ["--output-len", "3", "--exact-output", "--concurrency", "2", "--num-requests", "4"]
    assert bench.main([*argv, "--json", str(out)]) == 0

    report = json.loads(out.read_text())
    assert report["config"]["endpoint"] == "completions"
    assert report["config"]["prompt_kind"] == "random"
    assert report["config"]["exact_output"] is True
    for server, level in zip((usage_server, timings_server), report["servers"], strict=True):
        _check_level(level["levels"][0], 2, 4, 3)
        assert set(server.paths) == {"/v1/completions"}
        assert all("messages" not in b for b in server.bodies)
        assert all(b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] for b in server.bodies)
        # The fake tokenizer counts the tag as one word.
        assert level["levels"][0]["input_tokens_mean"] == 64 - bench.TAG_TOKENS + 1
    assert sorted(_prompt_bodies(usage_server)) == sorted(_prompt_bodies(timings_server))
    assert "below --output-len" not in capsys.readouterr().out


def test_random_prompts_are_seeded_and_about_the_requested_length():
    def workload(seed: int, input_len: int) -> object:
        return bench.Workload("chat", "random", input_len, 8, exact_output=False, seed=seed)

    a = workload(0, 512).prompt("1a2b3c4d-c1", 3)
    assert a == workload(0, 512).prompt("1a2b3c4d-c1", 3)
    assert a != workload(1, 512).prompt("1a2b3c4d-c1", 3)
    assert a != workload(0, 512).prompt("1a2b3c4d-c1", 4)
    head, words = a.split("] ", 1)
    assert head == "[1a2b3c4d-c1-3"
    assert set(words.split()) <= set(bench.COMMON_WORDS)
    # The tag is counted as TAG_TOKENS tokens, the words as one token each.
    assert len(words.split()) == 512 - bench.TAG_TOKENS
    # Same body after a different tag, so every server of a run sees the same text.
    assert workload(0, 512).prompt("ffffffff-c16", 3).split("] ", 1)[1] == words


def test_fixed_prompts_are_cut_or_repeated_to_the_requested_length():
    def fixed(input_len: int | None) -> str:
        return bench.Workload("chat", "fixed", input_len, 8, exact_output=False, seed=0).prompt(
            "tag", 0
        )

    assert fixed(None) == f"[tag-0] {bench.PROMPTS[0]}"
    for n in (20, 200):
        words = fixed(n).split("] ", 1)[1].split()
        approx = sum(bench.approx_tokens(w) for w in words)
        assert max(1, n - bench.TAG_TOKENS) <= approx <= max(1, n - bench.TAG_TOKENS) + 2
        assert " ".join(words[:3]) == " ".join(bench.PROMPTS[0].split()[:3])


def test_summarize_from_known_chunk_timings():
    R = report.RequestResult
    results = [
        R(chunk_times_s=[0.1, 0.2, 0.3, 0.5], e2e_s=0.5, output_tokens=4, input_tokens=10),
        R(chunk_times_s=[0.2, 0.25, 0.3], e2e_s=0.4, output_tokens=3, input_tokens=20),
        R(chunk_times_s=[0.05], e2e_s=9.0, output_tokens=1, error="HTTP 500: boom"),
    ]
    lv = report.summarize(2, results, wall_s=2.0)
    assert (lv.requests, lv.failed, lv.output_tokens) == (3, 1, 7)
    assert lv.first_error == "HTTP 500: boom"
    assert lv.output_tok_per_s == pytest.approx(3.5)
    assert lv.request_per_s == pytest.approx(1.0)
    assert lv.input_tokens_mean == pytest.approx(15.0)
    # TTFT over [0.1, 0.2]; the failed request's 0.05 is left out.
    assert (lv.ttft_mean_s, lv.ttft_p50_s) == pytest.approx((0.15, 0.15))
    assert (lv.ttft_p90_s, lv.ttft_p99_s) == pytest.approx((0.19, 0.199))
    # TPOT per request: (0.5 - 0.1) / 3 and (0.4 - 0.2) / 2.
    assert lv.tpot_mean_s == pytest.approx((0.4 / 3 + 0.1) / 2)
    assert lv.tpot_p50_s == pytest.approx((0.4 / 3 + 0.1) / 2)
    assert lv.tpot_p90_s == pytest.approx(0.1 + 0.9 * (0.4 / 3 - 0.1))
    # ITL pooled over both requests: [0.1, 0.1, 0.2] + [0.05, 0.05].
    assert (lv.itl_mean_s, lv.itl_p50_s) == pytest.approx((0.1, 0.1))
    assert (lv.itl_p90_s, lv.itl_p99_s) == pytest.approx((0.16, 0.196))
    assert (lv.e2e_mean_s, lv.e2e_p50_s, lv.e2e_p90_s) == pytest.approx((0.45, 0.45, 0.49))


def test_summarize_single_token_requests_have_ttft_only():
    results = [report.RequestResult(chunk_times_s=[t], e2e_s=t, output_tokens=1) for t in (1, 2)]
    lv = report.summarize(1, results, wall_s=3.0)
    assert lv.ttft_p50_s == pytest.approx(1.5)
    assert lv.tpot_mean_s is None and lv.itl_p50_s is None and lv.input_tokens_mean is None


def test_plot_writes_png(usage_server, timings_server, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plots" / "run.png"
    argv = ["--base-url", usage_server.base_url, "--peer-url", timings_server.base_url]
    argv += ["--concurrency", "1,2", "--num-requests", "2", "--output-len", "4"]
    assert bench.main([*argv, "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_percentile_matches_linear_interpolation():
    assert report.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert report.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert report.percentile([7.0], 90) == 7.0


def test_lone_prompt_ttft_recipe(usage_server, tmp_path):
    """--concurrency 1 --input-len 512 --output-len 1 --num-requests 5 measures TTFT alone."""
    out = tmp_path / "ttft.json"
    argv = ["--base-url", usage_server.base_url, "--concurrency", "1", "--input-len", "512"]
    argv += ["--output-len", "1", "--num-requests", "5", "--json", str(out)]
    assert bench.main(argv) == 0
    (level,) = json.loads(out.read_text())["servers"][0]["levels"]
    assert (level["requests"], level["failed"], level["output_tokens"]) == (5, 0, 5)
    assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"]
    assert level["tpot_mean_s"] is None and level["itl_p50_s"] is None
    # The fake tokenizer counts whitespace words, not punctuation, so it sees fewer than 512.
    assert 400 <= level["input_tokens_mean"] <= 512
    assert all(b["max_tokens"] == 1 for b in usage_server.bodies)
    assert bench.parse_args(["--max-tokens", "7"]).output_len == 7


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompts", "random"], "--prompts random needs --input-len"),
        (["--input-len", "0"], "--input-len must be positive"),
        (["--output-len", "0"], "--output-len (--max-tokens) must be positive"),
        (["--max-tokens", "-1"], "--output-len (--max-tokens) must be positive"),
        (["--concurrency", "1,x"], "expected integers like 1,4,16"),
        (["--concurrency", "0,4"], "--concurrency needs positive integers"),
        (["--endpoint", "embeddings"], "invalid choice"),
        (["--plot", "run.svg"], "give a path ending in .png"),
        (["--timeout", "0"], "--timeout must be positive"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err_lines) == 1 and message in err_lines[0]


def test_plot_without_matplotlib_is_a_one_line_error(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot", "run.png"])
    err_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err_lines) == 1 and "pip install matplotlib" in err_lines[0]


def test_candle_vllm_benchmark_py_flags():
    """candle-vllm's examples/benchmark.py line, --batch N --max_tokens M: N requests at once."""
    args = bench.parse_args(["--batch", "16", "--max_tokens", "64"])
    assert (args.concurrency, args.num_requests, args.output_len) == ([16], 16, 64)
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch", "0"])


interference = load_tool("bench_interference.py")


def test_itl_gaps_are_counted_in_the_phase_they_overlap():
    """A gap overlapping a long prompt's wait for its first token is a prefill gap."""
    R, Timed = report.RequestResult, interference.Timed
    background = [
        Timed(10.0, R(chunk_times_s=[0.1, 0.2, 1.2, 1.3], e2e_s=1.3, output_tokens=4)),
        Timed(11.0, R(chunk_times_s=[0.5, 0.6], e2e_s=0.6, output_tokens=2)),
        Timed(10.0, R(chunk_times_s=[0.1, 5.0], e2e_s=5.0, error="HTTP 500: boom")),
    ]
    longs = [Timed(10.5, R(chunk_times_s=[0.4], e2e_s=0.4, output_tokens=1))]  # busy 10.5-10.9
    assert interference.prefill_windows(longs) == [(10.5, pytest.approx(10.9))]
    gaps = interference.itl_by_phase(background, interference.prefill_windows(longs))
    assert gaps["prefill"] == pytest.approx([1.0])  # 10.2 -> 11.2
    assert sorted(gaps["calm"]) == pytest.approx([0.1, 0.1, 0.1])
    assert len(gaps["all"]) == 4
    result = interference.summarize("ours", background, longs, wall_s=2.0)
    assert (result.background_requests, result.background_failed) == (3, 1)
    assert result.background_tok_per_s == pytest.approx(3.0)
    assert result.long_ttft_p50_s == pytest.approx(0.4)
    assert result.itl["all"].max_s == pytest.approx(1.0)
    assert result.p99_over_p50 == pytest.approx(result.itl["all"].p99_s / 0.1)


def test_interference_load_against_two_servers(usage_server, timings_server, tmp_path, capsys):
    out = tmp_path / "interference.json"
    argv = ["--base-url", usage_server.base_url, "--peer-url", timings_server.base_url]
    argv += ["--load", "interference", "--streams", "2", "--duration", "1", "--long-every", "0.3"]
    argv += ["--long-len", "50", "--prompts", "random", "--input-len", "20"]
    argv += ["--output-len", "30", "--exact-output", "--json", str(out)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["config"]["load"] == "interference" and data["config"]["long_len"] == 50
    for server in (usage_server, timings_server):
        longs = [b for b in server.bodies if "-long-" in _prompt_text(b)]
        assert len(longs) == 3  # at 0.3, 0.6 and 0.9 s of a 1 s load
        assert all(b["max_tokens"] == 1 for b in longs)
        assert all(len(_prompt_text(b).split()) == 50 - bench.TAG_TOKENS + 1 for b in longs)
    for result in data["servers"]:
        itl = result["itl"]
        assert itl["all"]["samples"] == itl["calm"]["samples"] + itl["prefill"]["samples"] > 0
        assert result["background_requests"] >= 2 and result["long_prompts"] == 3
        assert result["background_failed"] == result["long_failed"] == 0
    printed = capsys.readouterr().out
    assert "by phase" in printed and "ours/peer: ITL p99" in printed


def test_burst_load_sends_32_requests_at_once():
    args = bench.parse_args(["--load", "burst", "--prompts", "random", "--input-len", "256"])
    assert (args.concurrency, args.num_requests) == ([32], 32)
    assert bench.parse_args(["--load", "burst", "--batch", "8"]).concurrency == [8]
    with pytest.raises(SystemExit):
        bench.parse_args(["--load", "interference", "--long-every", "0"])
