"""What compiles before a server is ready: the steps of one request at a short context (its
prompt chunks and its decode), then everything else in the background, short contexts first and
each context's single steps before its multi-step decode, losing no shape."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.engine.model_runner import SAMPLER
from jax_llm_runtime.runtime.engine.request import SamplingParams
from tests.models.harness import save_tiny_byte_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_byte_llama(folder)
    return folder


def _build(folder: Path, **fields: object):
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    return build_engine(
        EngineConfig(
            model_id=str(folder), max_num_seqs=4, max_model_len=128, dtype="float32", **fields
        )
    )


@pytest.fixture(scope="module")
def engine(folder: Path):
    engine = _build(folder)
    yield engine
    engine.shutdown()


def _greedy(engine, text: str, max_tokens: int) -> list[int]:
    ids = engine.tokenizer.encode(text)

    async def one() -> list[int]:
        tokens: list[int] = []
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        async for delta in engine.generate(ids, sampling, f"greedy-{text}"):
            tokens += delta.token_ids
        return tokens

    return asyncio.run(one())


def _steps(keys: list[tuple]) -> list[tuple]:
    return [key for key in keys if key[0] != SAMPLER]


def test_ready_with_one_requests_shapes_and_the_rest_in_order(engine) -> None:
    runner = engine.runner
    first, rest = runner.startup_shapes()
    # The sampler compiles once per count of rows: one row before serving, the others first
    # in the background (every step of that many rows needs it).
    assert [k for k in first if k[0] == SAMPLER] == [(SAMPLER, 1)]
    samplers = [k for k in rest if k[0] == SAMPLER]
    assert rest[: len(samplers)] == samplers
    rows = {s[1] for s in runner.plan.shapes()}
    assert sorted(n for _, n in samplers) == sorted(rows - {1})
    first, rest = _steps(first), _steps(rest)
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
    single = [key for key in requested if key[0] == SAMPLER or key[3] == 1]
    assert single and all(key in first for key in single), (single, first)
    assert (SAMPLER, 1) in single


def test_precompile_none_compiles_each_shape_when_a_step_needs_it(engine, folder: Path) -> None:
    """``--precompile none``: the start compiles nothing; a request still runs, its single and
    multi-step decode shapes compiling as its steps first ask, with the default start's tokens."""
    engine.start()
    lazy = _build(folder, precompile="none")
    try:
        lazy.start()
        assert len(lazy.runner.compiled) == 0 and lazy.compile_done.is_set()
        tokens = _greedy(lazy, "a short prompt", 10)
        assert tokens == _greedy(engine, "a short prompt", 10)
        _, rest = lazy.runner.startup_shapes()
        multi = [key for key in _steps(rest) if key[3] > 1]
        assert any(key in lazy.runner.compiled for key in multi), "a multi-step decode ran"
        # a prompt chunk, the decode shapes, and the sampler of one row
        assert (SAMPLER, 1) in lazy.runner.compiled
        assert 0 < len(lazy.runner.compiled) <= 5
    finally:
        lazy.shutdown()


def test_precompile_is_checked() -> None:
    from jax_llm_runtime.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="precompile must be one of first, all, none"):
        EngineConfig(precompile="lazy")
