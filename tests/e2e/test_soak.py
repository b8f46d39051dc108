"""Soak: 300 requests at concurrency 32 on a KV cache small enough to force preemption, a fifth of
the clients disconnecting mid-stream.

Every completed response must equal its greedy reference (the same request served alone
first, so never preempted); at the end every KV page is free again and the server's resident
memory has not grown over the run. ``just soak`` runs this file alone and prints the figures.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.serve_process import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_REQUESTS = 300
CONCURRENCY = 32
DISCONNECT_EVERY = 5  # request i disconnects after a few chunks when i % 5 == 0: 20%
TOPICS = [
    "the moon", "bread", "rivers", "owls", "glass", "winter", "bicycles", "tea", "volcanoes",
    "bees", "maps", "clocks", "salt", "whales", "paper", "thunder", "gardens", "copper",
    "lighthouses", "chess", "deserts", "violins", "bridges", "coral",
]  # fmt: skip
# SmolLM2 K/V take ~45 KiB per token in float32: 16 MiB hold 22 pages of 16 tokens, while 8
# running sequences of up to ~80 tokens need up to 40, so sequences are preempted again and again.
# The cache is float32 on every CPU (the default is float16 where int8 activations run, which
# would hold 45 pages and preempt nothing there).
SERVER_ARGS = [
    "--max-model-len", "256", "--max-num-seqs", "8", "--kvcache-mem", "16",
    "--kv-cache-dtype", "float32",
]  # fmt: skip
MAX_RSS_GROWTH_MB = 64


def body(i: int, stream: bool) -> dict:
    topic = TOPICS[i % len(TOPICS)]
    return {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": f"Write three sentences about {topic}."}],
        "temperature": 0,
        "max_tokens": 16 + (i % len(TOPICS)) % 4 * 8,  # 16 to 40, fixed per topic
        "stream": stream,
    }


def stream_text(
    client: httpx.Client, url: str, payload: dict, stop_after: int | None
) -> str | None:
    """The streamed content; None when the client hung up after ``stop_after`` chunks."""
    text, chunks = [], 0
    with client.stream("POST", f"{url}/chat/completions", json=payload) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            for choice in event["choices"]:
                text.append(choice["delta"].get("content") or "")
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return None  # leaving the block closes the connection mid-stream
    return "".join(text)


def one_request(client: httpx.Client, url: str, i: int) -> tuple[int, str | None, float]:
    start = time.perf_counter()
    if i % DISCONNECT_EVERY == 0:
        text = stream_text(client, url, body(i, True), stop_after=3)
    elif i % 2:
        text = stream_text(client, url, body(i, True), stop_after=None)
    else:
        response = client.post(f"{url}/chat/completions", json=body(i, False))
        response.raise_for_status()
        text = response.json()["choices"][0]["message"]["content"]
    return i, text, time.perf_counter() - start


def metric(client: httpx.Client, url: str, name: str) -> float:
    page = client.get(url.removesuffix("/v1") + "/metrics").text
    # One served model: its series carries a model_name label.
    match = re.search(rf"^runtime_{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", page, re.MULTILINE)
    assert match, f"no runtime_{name} in /metrics"
    return float(match[1])


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)[1]) / 1024


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    log = tmp_path_factory.mktemp("soak") / "server.log"
    with running_server(SERVER_ARGS, log) as proc:
        yield proc
    assert "Traceback" not in log.read_text()


def test_soak_with_preemption_and_disconnects(server) -> None:
    url = server.url
    with httpx.Client(timeout=600) as client:
        # The references: each distinct request alone, so never preempted.
        reference = {}
        for i in range(len(TOPICS)):
            reply = client.post(f"{url}/chat/completions", json=body(i, False)).json()
            reference[i % len(TOPICS)] = reply["choices"][0]["message"]["content"]
        preemptions_before = metric(client, url, "num_preemptions")
    rss_start = rss_mb(server.pid)

    results, errors = [], []
    rss_mid = None
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=CONCURRENCY)
    with (
        httpx.Client(timeout=600, limits=limits) as client,
        concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool,
    ):
        futures = [pool.submit(one_request, client, url, i) for i in range(NUM_REQUESTS)]
        for n, future in enumerate(concurrent.futures.as_completed(futures)):
            try:
                results.append(future.result())
            except Exception as exc:  # every failure is counted and reported
                errors.append(repr(exc))
            if n == NUM_REQUESTS // 3:
                rss_mid = rss_mb(server.pid)
    elapsed = time.perf_counter() - started

    with httpx.Client(timeout=60) as client:
        preemptions = metric(client, url, "num_preemptions") - preemptions_before
        deadline = time.monotonic() + 30  # aborted sequences free their pages on the next step
        while metric(client, url, "kv_pages_used") and time.monotonic() < deadline:
            time.sleep(0.2)
        pages_used = metric(client, url, "kv_pages_used")
        running = metric(client, url, "num_requests_running")
        waiting = metric(client, url, "num_requests_waiting")
        health = client.get(url.removesuffix("/v1") + "/health").status_code
    rss_end = rss_mb(server.pid)

    completed = [(i, text, s) for i, text, s in results if text is not None]
    mismatched = [i for i, text, _ in completed if text != reference[i % len(TOPICS)]]
    latencies = np.array([s for _, _, s in completed])
    figures = {
        "requests": NUM_REQUESTS,
        "concurrency": CONCURRENCY,
        "completed": len(completed),
        "disconnected": len(results) - len(completed),
        "errors": len(errors),
        "mismatched": len(mismatched),
        "preemptions": int(preemptions),
        "p50_latency_s": round(float(np.percentile(latencies, 50)), 2),
        "p99_latency_s": round(float(np.percentile(latencies, 99)), 2),
        "elapsed_s": round(elapsed, 1),
        "rss_mb_start_mid_end": [round(rss_start), round(rss_mid or 0), round(rss_end)],
    }
    print("soak:", json.dumps(figures))
    assert not errors, errors[:5]
    assert not mismatched, f"requests {mismatched[:10]} differ from their greedy reference"
    assert len(completed) == NUM_REQUESTS - NUM_REQUESTS // DISCONNECT_EVERY
    assert preemptions > 0, "the KV budget was meant to force preemption"
    assert (pages_used, running, waiting) == (0, 0, 0)
    assert health == 200
    # Flat: what the first third of the run settled at does not keep growing.
    assert rss_end - rss_mid < MAX_RSS_GROWTH_MB, figures["rss_mb_start_mid_end"]
