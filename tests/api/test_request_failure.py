"""A request whose work raises fails alone, with a 500 and the envelope; the engine serves the
others on, and the requests batched with it lose nothing.

The real ``Engine`` runs over a scripted runner (``tests.api.stub_engine``) that raises while a
sequence with a chosen prompt is in the step, with the KV cache intact (unlike a device failure,
which ``test_engine_death`` covers).
"""

from __future__ import annotations

import asyncio
import json

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.runtime.engine.model_runner import StepResult
from jax_llm_runtime.runtime.engine.scheduler import ScheduledBatch
from tests.api.conftest import assert_error, sse_data
from tests.api.inprocess import app_client
from tests.api.stub_engine import StubRunner, StubTokenizer, stub_engine

POISON = "poison"


def completion(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, **kw}


async def test_a_failing_request_fails_alone_and_the_others_finish() -> None:
    engine, runner = stub_engine(max_num_seqs=4, step_s=0.002)
    runner.fail_prompt = list(POISON.encode())
    async with app_client(create_app(engine)) as client:
        bodies = [
            completion("alpha"),
            completion(POISON),
            completion("beta", stream=True),
            completion(POISON, stream=True),
            completion("gamma"),
        ]
        responses = await asyncio.wait_for(
            asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)), 30
        )
        for response in (responses[0], responses[4]):
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["text"] == "x" * 40 and choice["finish_reason"] == "length"
        events = [json.loads(d) for d in sse_data(responses[2].text)[:-1]]
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        assert text == "x" * 40 and events[-1]["choices"][0]["finish_reason"] == "length"

        error = assert_error(responses[1], 500)
        assert error["type"] == "internal_server_error"
        data = sse_data(responses[3].text)
        assert data[-1] == "[DONE]" and "error" in json.loads(data[-2])

        # Still serving: healthy, and the next request completes; every page came back.
        assert engine.healthy()
        assert (await client.get("/health")).status_code == 200
        again = await client.post("/v1/completions", json=completion("delta"))
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == "x" * 40
        allocator = engine.scheduler.allocator
        assert allocator.num_free == allocator.num_pages
        assert max(runner.batch_sizes) >= 2, "the requests were meant to share steps"


async def test_repeating_a_failing_request_does_not_stop_the_server() -> None:
    engine, runner = stub_engine()
    runner.fail_prompt = list(POISON.encode())
    async with app_client(create_app(engine)) as client:
        for _ in range(5):
            assert_error(await client.post("/v1/completions", json=completion(POISON)), 500)
        assert engine.healthy()
        ok = await client.post("/v1/completions", json=completion("fine"))
        assert ok.status_code == 200


BAD = ord("!")  # the token the detokenizer below cannot decode


class _BadByteTokenizer(StubTokenizer):
    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        if BAD in token_ids:
            raise UnicodeDecodeError("bytes", bytes([BAD]), 0, 1, "injected decode failure")
        return super().decode(token_ids, skip_special_tokens)


class _BadTokenRunner(StubRunner):
    """Samples ``BAD`` for sequences whose prompt ends with POISON once they have five tokens
    (so a stream has started), ``TOKEN`` otherwise."""

    def run(self, batch: ScheduledBatch) -> StepResult:
        result = super().run(batch)
        poison = list(POISON.encode())
        for row, item in enumerate(batch.items):
            if item.seq.prompt_ids[-len(poison) :] == poison and len(item.seq.output_ids) >= 5:
                result.token_ids[row] = [BAD] * batch.num_steps
        return result


async def test_a_request_whose_detokenization_raises_fails_alone() -> None:
    engine, _ = stub_engine(runner=_BadTokenRunner(0.002), tokenizer=_BadByteTokenizer())
    async with app_client(create_app(engine)) as client:
        bodies = [completion("alpha"), completion(POISON), completion(POISON, stream=True)]
        ok, bad, bad_stream = await asyncio.wait_for(
            asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)), 30
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "x" * 40
        assert assert_error(bad, 500)["type"] == "internal_server_error"
        data = sse_data(bad_stream.text)
        assert data[-1] == "[DONE]" and "error" in json.loads(data[-2])
        assert engine.healthy()
        again = await client.post("/v1/completions", json=completion("beta"))
        assert again.status_code == 200
        await asyncio.sleep(0.1)  # the aborts reach the loop thread between steps
        allocator = engine.scheduler.allocator
        assert allocator.num_free == allocator.num_pages
