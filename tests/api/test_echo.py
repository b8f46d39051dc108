"""``echo`` on /v1/completions: the prompt leads the text, and with ``logprobs`` its tokens are
scored too (the first one, having no context, with nulls)."""

from __future__ import annotations

from typing import Any

from litestar.testing import TestClient

from tests.api.conftest import sse_chunks


def test_echo_prepends_the_prompt(client: TestClient[Any]) -> None:
    plain = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).json()
    echoed = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "echo": True})
    assert echoed.json()["choices"][0]["text"] == "abc" + plain["choices"][0]["text"]


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(client: TestClient[Any]) -> None:
    body = {"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 1}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["tokens"][:4] == ["<s>", "a", "b", "c"] and len(lp["tokens"]) == 6  # BOS added
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:4] == [-1.0, -1.0, -1.0]  # the mock engine's prompt scores
    assert lp["text_offset"] == [0, 3, 4, 5, 6, 7]  # over the token texts, as in vLLM


def test_streamed_echo_sends_the_prompt_first(client: TestClient[Any]) -> None:
    body = {"prompt": "abc", "max_tokens": 2, "echo": True, "stream": True}
    chunks = sse_chunks(client.post("/v1/completions", json=body).text)
    assert chunks[0]["choices"][0]["text"] == "abc"
    whole = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
