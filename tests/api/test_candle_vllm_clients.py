"""The requests candle-vllm's own clients send, recorded field for field from its
``examples/benchmark.py`` and ``examples/chat.py`` with their default flags (the openai SDK sends
an argument given as None as JSON null, and ``extra_body`` as it is), get a 200 stream here.

benchmark.py: ``model="any"``, ``max_tokens`` 1,024, ``temperature`` 0.0, the other sampling
arguments None, ``stream_options.include_usage``, and an ``extra_body`` with only the set keys.
chat.py: ``model=""``, ``max_tokens`` 16,384, ``temperature`` and ``top_p`` None, and an
``extra_body`` whose every key is present, null unless a flag set it (``thinking``,
``repeat_last_n``, vLLM.rs's ``session_id``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from litestar.testing import TestClient

from tests.api.conftest import MAX_MODEL_LEN

MESSAGES = [{"role": "user", "content": "Tell me a story."}]

BENCHMARK_PY = {
    "model": "any",
    "messages": MESSAGES,
    "max_tokens": 1024,
    "temperature": 0.0,
    "top_p": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "stream": True,
    "stream_options": {"include_usage": True},
}
BENCHMARK_PY_FLAGS = {"top_k": 40, "min_p": 0.05, "repeat_last_n": 64, "thinking": False}
CHAT_PY = {
    "model": "",
    "messages": [{"role": "system", "content": "You are a helpful assistant."}, *MESSAGES],
    "stream": True,
    "max_tokens": 16384,
    "temperature": None,
    "top_p": None,
    "top_k": None,
    "min_p": None,
    "frequency_penalty": None,
    "presence_penalty": None,
    "thinking": None,
    "repeat_last_n": None,
    "session_id": None,
}


def _events(response: Any) -> list[dict[str, Any]]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


@pytest.mark.parametrize(
    "body",
    [BENCHMARK_PY, {**BENCHMARK_PY, **BENCHMARK_PY_FLAGS}, {**BENCHMARK_PY, "ignore_eos": True}],
    ids=["benchmark.py", "benchmark.py-sampling-flags", "benchmark.py-ignore-eos"],
)
def test_candle_vllm_benchmark_py_request_streams(client: TestClient[Any], body: dict) -> None:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    events = _events(response)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text
    assert all(e["model"] == "mock-model" for e in events)
    usage = events[-1]["usage"]  # include_usage: the last chunk carries the counts
    assert usage["completion_tokens"] > 0
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= MAX_MODEL_LEN


@pytest.mark.parametrize(
    "body",
    [CHAT_PY, {**CHAT_PY, "thinking": True, "repeat_last_n": 32, "temperature": 0.7}],
    ids=["chat.py", "chat.py-flags"],
)
def test_candle_vllm_chat_py_request_streams(client: TestClient[Any], body: dict) -> None:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    events = _events(response)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
