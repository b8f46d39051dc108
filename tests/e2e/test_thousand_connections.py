"""1,000 streaming chats opened at once against the real model: every one ends, either served in
full (200, its stream closed by ``[DONE]``) or refused at once with 503, the OpenAI envelope and
``Retry-After`` once the running slots and the waiting queue (``--max-waiting``) are full. None
hangs or fails otherwise; afterwards every KV page is free, nothing runs or waits, and the server's
resident memory under the load stayed within 20% of the idle server's plus its KV cache."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_soak import metric, rss_mb
from tests.serve_process import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONNECTIONS = 1000
MAX_NUM_SEQS, MAX_WAITING, KV_MB = 16, 128, 64
SERVER_ARGS = [
    "--max-model-len", "256", "--max-num-seqs", str(MAX_NUM_SEQS),
    "--max-waiting", str(MAX_WAITING), "--kvcache-mem", str(KV_MB),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    log = tmp_path_factory.mktemp("connections") / "server.log"
    with running_server(SERVER_ARGS, log) as proc:
        yield proc
    assert "Traceback" not in log.read_text()


def body(i: int) -> dict:
    return {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": f"Count to {i % 10 + 2}."}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }


async def one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    """(status, outcome): 200 "done" when the stream ended with [DONE] after a finish reason,
    503 "refused" when the envelope and Retry-After came back; anything else is reported."""
    async with client.stream("POST", f"{url}/chat/completions", json=body(i)) as reply:
        if reply.status_code == 503:
            error = json.loads(await reply.aread())["error"]
            ok = error["type"] and "retry-after" in reply.headers
            return 503, "refused" if ok else f"bad 503 {error}"
        finished, done = False, False
        async for line in reply.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return reply.status_code, f"error event {event}"
                finished |= any(c.get("finish_reason") for c in event.get("choices", []))
        return reply.status_code, "done" if finished and done else "unfinished"


async def load(url: str) -> list[tuple[int, str]]:
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(*(one(client, url, i) for i in range(CONNECTIONS)))


def test_a_thousand_streams_at_once(server) -> None:
    url = server.url
    with httpx.Client(timeout=120) as client:
        client.post(f"{url}/chat/completions", json={**body(0), "stream": False})
        # Warm-up ends with the background compile (each compiled shape holds memory).
        deadline = time.monotonic() + 600
        while metric(client, url, "compiling") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert metric(client, url, "compiling") == 0, "the background compile did not end"
    idle = rss_mb(server.pid)
    peak, stop = [idle], threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak.append(rss_mb(server.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    try:
        outcomes = asyncio.run(asyncio.wait_for(load(url), 900))
    finally:
        stop.set()
        sampler.join()
    elapsed = time.perf_counter() - started

    with httpx.Client(timeout=60) as client:
        deadline = time.monotonic() + 30
        while metric(client, url, "kv_pages_used") and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = [
            metric(client, url, name)
            for name in ("kv_pages_used", "num_requests_running", "num_requests_waiting")
        ]
        health = client.get(url.removesuffix("/v1") + "/health").status_code

    served = sum(outcome == "done" for _, outcome in outcomes)
    refused = sum(outcome == "refused" for _, outcome in outcomes)
    figures = {
        "connections": CONNECTIONS,
        "served": served,
        "refused_503": refused,
        "elapsed_s": round(elapsed, 1),
        "rss_mb_idle_peak": [round(idle), round(max(peak))],
    }
    print("connections:", json.dumps(figures))
    others = [o for o in outcomes if o[1] not in ("done", "refused")]
    assert not others, others[:5]
    assert served >= MAX_NUM_SEQS + MAX_WAITING and refused > 0
    assert leftovers == [0, 0, 0] and health == 200
    assert max(peak) <= 1.2 * idle + KV_MB, figures
