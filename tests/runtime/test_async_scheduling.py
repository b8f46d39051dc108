"""Async scheduling through the whole engine on a tiny random Llama: decode calls dispatched
before the tokens of the call running ahead of them reach the host give exactly the tokens of
calls scheduled one after the other, also as sequences finish, hit ``min_tokens`` or are
aborted while a call ahead runs, and no page is lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.engine.request import SamplingParams
from tests.models.harness import save_tiny_byte_llama

pytestmark = pytest.mark.slow

PROMPTS = ["Hello there", "The quick brown fox", "1 2 3", "abc", "zzz", "Once upon a time"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_byte_llama(folder)
    return folder


def _requests() -> list[SamplingParams]:
    """Greedy and seeded requests of different lengths (so sequences leave while others run
    on), one that may stop on any of a few ids only after 9 tokens."""
    out = []
    for i, _ in enumerate(PROMPTS):
        out.append(
            SamplingParams(
                temperature=0.0 if i % 2 else 0.9,
                top_p=0.9 if i % 3 == 0 else 1.0,
                seed=100 + i,
                max_tokens=12 + 5 * i,
                ignore_eos=True,
            )
        )
    out[2] = SamplingParams(
        temperature=1.0, seed=7, max_tokens=30, min_tokens=9, stop_token_ids=tuple(range(97, 123))
    )
    return out


def _run(folder: Path, async_scheduling: bool, abort_after: int | None = None) -> tuple:
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    engine = build_engine(
        EngineConfig(
            model_id=str(folder),
            max_num_seqs=8,
            max_model_len=96,
            dtype="float32",
            async_scheduling=async_scheduling,
            # A read of K/V left over from a freed page turns into NaN logits.
            debug_fill_freed_pages=True,
        )
    )
    aheads = []
    schedule_ahead = engine.scheduler.schedule_ahead

    def counted(batch, steps):
        ahead = schedule_ahead(batch, steps)
        aheads.append(ahead)
        return ahead

    engine.scheduler.schedule_ahead = counted
    engine.start(compile_all=True)
    try:
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]

        async def one(i: int, sampling: SamplingParams) -> list[int]:
            out: list[int] = []
            stream = engine.generate(prompts[i], sampling, f"r{i}")
            async for delta in stream:
                out += delta.token_ids
                if i == 0 and abort_after is not None and len(out) >= abort_after:
                    await stream.aclose()
                    break
            return out

        async def run_all() -> list[list[int]]:
            requests = _requests()
            return await asyncio.gather(*(one(i, sp) for i, sp in enumerate(requests)))

        outputs = asyncio.run(run_all())
        allocator = engine.scheduler.allocator
        return outputs, aheads, allocator.num_free, allocator.num_pages
    finally:
        engine.shutdown()


def test_calls_scheduled_ahead_give_the_tokens_of_calls_one_after_the_other(model_dir) -> None:
    ours, aheads, free, pages = _run(model_dir, async_scheduling=True)
    expected, none, _, _ = _run(model_dir, async_scheduling=False)
    assert not none  # with async scheduling off, nothing is scheduled ahead
    ahead = [a for a in aheads if a is not None]
    # Calls of one step (more sequences than multi-step takes) and of four ran ahead.
    assert len(ahead) >= 5
    assert {a.num_steps for a in ahead} == {1, 4}
    assert ours == expected
    requests = _requests()
    for i, tokens in enumerate(ours):
        if i != 2:
            assert len(tokens) == requests[i].max_tokens
    # The stop ids were banned for 9 tokens, then one of them ended the request (or the length).
    assert 9 < len(ours[2]) <= 30
    assert all(t not in range(97, 123) for t in ours[2][:9])
    assert free == pages  # every page came back, also those of the calls ahead


def test_an_abort_while_a_call_runs_ahead_leaves_the_others_unchanged(model_dir) -> None:
    ours, aheads, free, pages = _run(model_dir, async_scheduling=True, abort_after=3)
    expected, _, _, _ = _run(model_dir, async_scheduling=False)
    assert any(a is not None for a in aheads)
    assert 3 <= len(ours[0]) < _requests()[0].max_tokens
    assert ours[0] == expected[0][: len(ours[0])]
    assert ours[1:] == expected[1:]
    assert free == pages
