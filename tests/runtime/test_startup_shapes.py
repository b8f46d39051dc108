"""What compiles before a server is ready: the steps of one request at a short context (its
prompt chunks and its decode), then everything else in the background, short contexts first and
each context's single steps before its multi-step decode, losing no shape."""

from __future__ import annotations

import asyncio

import pytest

from jax_llm_runtime.runtime.engine.request import SamplingParams
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    from transformers import LlamaConfig

    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(**{**TINY, "vocab_size": VOCAB_SIZE, "bos_token_id": 256})
    config.eos_token_id = None
    save_random_model(config, folder)
    save_byte_tokenizer(folder)
    engine = build_engine(
        EngineConfig(model_id=str(folder), max_num_seqs=4, max_model_len=128, dtype="float32")
    )
    yield engine
    engine.shutdown()


def test_ready_with_one_requests_shapes_and_the_rest_in_order(engine) -> None:
    runner = engine.runner
    first, rest = runner.startup_shapes()
    shortest = runner.plan.pages[0]
    lone = sorted(s for s in runner.plan.shapes() if s[1] == 1 and s[2] == shortest)
    assert sorted(first) == [(*s, 1) for s in lone]
    assert (1, 1, shortest, 1) in first  # the lone request's decode
    assert len(first) < len([s for s in runner.plan.shapes() if s[2] == shortest])
    everything = [(*s, 1) for s in runner.plan.shapes()]
    multi = [s for s in rest if s[3] > 1]
    assert multi, "CPU decodes several steps per call by default"
    assert sorted(first + [s for s in rest if s[3] == 1]) == sorted(everything)
    order = [(s[2], s[3]) for s in rest]
    assert order == sorted(order)  # short contexts first, single steps before multi-step


def test_a_lone_request_is_served_by_the_startup_shapes(engine) -> None:
    # Right after start (the background compile going on beside it), a lone request's single
    # steps all land in shapes compiled before the start returned.
    first, _ = engine.runner.startup_shapes()
    requested: list[tuple] = []
    get = engine.runner.compiled.get

    def recorded(key):
        requested.append(key)
        return get(key)

    engine.runner.compiled.get = recorded
    engine.start()
    assert all(key in engine.runner.compiled for key in first)
    ids = engine.tokenizer.encode("a short prompt")

    async def one() -> list[int]:
        tokens: list[int] = []
        async for delta in engine.generate(ids, SamplingParams(max_tokens=6), "lone"):
            tokens += delta.token_ids
        return tokens

    assert len(asyncio.run(one())) == 6
    single = [key for key in requested if key[3] == 1]
    assert single and all(key in first for key in single), (single, first)
