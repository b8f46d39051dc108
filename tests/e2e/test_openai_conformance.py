"""OpenAI conformance against a real ``runtime-serve`` (SmolLM2): the official SDK, sync and async,
and raw HTTP, over every request field the server accepts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_process import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Tell me about the moon in three sentences."}]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("conformance") / "server.log"
    args = ["--max-model-len", "512", "--max-num-seqs", "8", "--kvcache-mem", "64"]
    with running_server(args, log) as proc:
        yield proc.url
    assert "Traceback" not in log.read_text()


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def metrics(server: str) -> dict[str, float]:
    text = httpx.get(server.removesuffix("/v1") + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_sampling_field_is_accepted_and_shapes_the_response(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={"30": -100},  # "." (28 is ",")
        seed=7,
        max_completion_tokens=12,
        stop=["\n\n"],
        logprobs=True,
        top_logprobs=3,
        user="conformance",
        n=2,
        extra_body={
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "repeat_last_n": 64,
            "min_tokens": 4,
            "stop_token_ids": [],
            "ignore_eos": False,
            "skip_special_tokens": True,
        },
    )
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.finish_reason in ("stop", "length")
        tokens = choice.logprobs.content
        assert 4 <= len(tokens) <= 12
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in tokens)
        # Banned: never sampled, and the reported distributions (after logit_bias) rank it last.
        assert all(t.token != "." for t in tokens)
        assert all(alt.token != "." for t in tokens for alt in t.top_logprobs)
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)


def test_special_tokens_shown_on_request_but_never_the_final_eos(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "temperature": 0, "max_tokens": 40}
    reply = client.chat.completions.create(
        messages=[{"role": "user", "content": "Say hi."}],
        extra_body={"skip_special_tokens": False},
        **kw,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in reply.choices[0].message.content


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        kw = {"temperature": 1.0, "max_tokens": 16, "seed": seed}
        return (
            client.chat.completions.create(model=MODEL, messages=ASK, **kw)
            .choices[0]
            .message.content
        )

    assert sample(1234) == sample(1234)


def test_streaming_equals_non_streaming_with_async_sdk(server: str) -> None:
    async def run() -> None:
        aclient = openai.AsyncOpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)
        kw = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 24, "n": 2}
        whole = await aclient.chat.completions.create(**kw)
        stream = await aclient.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        texts, finishes, usage = {0: "", 1: ""}, {0: [], 1: []}, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finishes[choice.index].append(choice.finish_reason)
        assert texts == {c.index: c.message.content for c in whole.choices}
        assert [len(f) for f in finishes.values()] == [1, 1]
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens

    asyncio.run(run())


def test_completions_with_integer_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The moon is", max_tokens=6, temperature=0, logprobs=2
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    assert "".join(lp.tokens) == reply.choices[0].text


def test_completions_echo_scores_the_prompt(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The moon is", max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    choice, usage = reply.choices[0], reply.usage
    assert choice.text.startswith("The moon is") and len(choice.text) > len("The moon is")
    lp = choice.logprobs
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


def test_raw_http_service_endpoints(server: str) -> None:
    root = server.removesuffix("/v1")
    ids = httpx.post(f"{root}/tokenize", json={"prompt": "Hello moon"}, timeout=10).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = httpx.post(f"{root}/detokenize", json={"tokens": ids["tokens"]}, timeout=10).json()
    assert text["prompt"] == "Hello moon"
    assert httpx.get(f"{root}/version", timeout=10).json()["version"]
    bad = httpx.post(
        f"{server}/chat/completions", json={"model": MODEL, "messages": ASK, "temperature": -1}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    long = httpx.post(
        f"{server}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi " * 600}]},
        timeout=30,
    )
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"


def test_sixteen_streams_cancelled_mid_way_free_every_page(
    server: str, client: openai.OpenAI
) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 200, "stream": True, "temperature": 1.0}

    async def start_and_drop(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", f"{server}/chat/completions", json=body) as response:
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    return  # leave mid-stream: the connection closes

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(start_and_drop(http) for _ in range(16)))

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["runtime_kv_pages_free"] == m["runtime_kv_pages_total"]:
            break
        time.sleep(0.2)
    assert m["runtime_kv_pages_free"] == m["runtime_kv_pages_total"]
    assert m["runtime_num_requests_running"] == 0 and m["runtime_num_requests_waiting"] == 0
    after = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length") and after.choices[0].message.content
