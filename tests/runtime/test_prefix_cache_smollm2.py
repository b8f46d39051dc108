"""Prefix caching and the NaN fill of handed-out pages, on the real SmolLM2-135M-Instruct engine.

Both switches are plain attributes of the shared engine's scheduler and allocator, flipped here
between workloads while the engine is idle. Greedy tokens must not depend on either: a cached
prefix holds exactly the K/V the sequence would have computed, and no request may read a page
position it did not write (with the fill on, such a read would make its logprobs NaN).
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import from_stored
from jax_llm_runtime.runtime.engine.request import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant for a small library. Answer in one short sentence, name the "
    "shelf when you know it, and say so plainly when you do not know. The library opens at nine "
    "and closes at five; children's books are on the first floor, science on the second."
)
QUESTIONS = [
    "Where are the science books?",
    "When does the library open?",
    "Do you have books about whales?",
    "Where do children find picture books?",
    "Can I return a book on Sunday?",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


def chat(engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def prompts(engine) -> list[list[int]]:
    return [
        chat(engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]


async def generate(engine, ids, request_id, n=1, logprobs=None):
    """(tokens per sample, cached tokens, logprobs per sample) of one greedy request."""
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=logprobs)
    streams = engine.generate_n(ids, sampling, request_id, n)
    tokens, cached, lps = [], 0, []
    for stream in streams:
        out, values = [], []
        async for delta in stream:
            out += delta.token_ids
            values += [lp.logprob for lp in delta.logprobs]
            cached = max(cached, delta.num_cached_tokens)
        tokens.append(out)
        lps.append(values)
    return tokens, cached, lps


async def workload(engine, tag: str, logprobs=None):
    """The first prompt alone, then the others concurrently, then a second turn of each, plus
    an n=2 request: shared system prompt, shared earlier turns, forks."""
    first = prompts(engine)
    results = [await generate(engine, first[0], f"{tag}-0", logprobs=logprobs)]
    results += await asyncio.gather(
        *(generate(engine, ids, f"{tag}-{i}", logprobs=logprobs) for i, ids in enumerate(first))
    )
    follow_ups = []
    for q, (tokens, _, _) in zip(QUESTIONS, results[1:], strict=True):
        answer = engine.tokenizer.decode(tokens[0])
        follow_ups.append(
            chat(
                engine,
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Thanks. And one more thing?"},
                ],
            )
        )
    results += await asyncio.gather(
        *(
            generate(engine, ids, f"{tag}-t2-{i}", logprobs=logprobs)
            for i, ids in enumerate(follow_ups)
        ),
        generate(engine, first[2], f"{tag}-n", n=2, logprobs=logprobs),
    )
    return results


@contextlib.contextmanager
def switches(engine, prefix_cache: bool, fill: bool = False):
    scheduler, allocator = engine.scheduler, engine.scheduler.allocator
    saved = scheduler.prefix_cache, allocator.track_fresh
    scheduler.prefix_cache, allocator.track_fresh = prefix_cache, fill
    allocator.take_fresh()
    try:
        yield
    finally:
        scheduler.prefix_cache, allocator.track_fresh = saved
        allocator.take_fresh()


def test_prefix_cache_on_or_off_gives_the_same_greedy_tokens(engine):
    with switches(engine, prefix_cache=False):
        off = asyncio.run(workload(engine, "off"))
    with switches(engine, prefix_cache=True):
        hits_before = engine.stats().num_prefix_cache_hits
        on = asyncio.run(workload(engine, "on"))
        hits = engine.stats().num_prefix_cache_hits - hits_before
    assert [tokens for tokens, _, _ in on] == [tokens for tokens, _, _ in off]
    assert all(cached == 0 for _, cached, _ in off)
    system_pages = len(chat(engine, [{"role": "system", "content": SYSTEM}])) // 16 * 16
    # After the first request, every prompt starts with the cached system prompt, and a second
    # turn also finds its first turn (prompt and answer) cached.
    assert all(cached >= system_pages for _, cached, _ in on[1:]), [c for _, c, _ in on]
    first_turns = [len(ids) for ids in prompts(engine)]
    for (_, cached, _), first_len in zip(on[6:11], first_turns, strict=True):
        assert cached >= first_len // 16 * 16
    assert hits == sum(cached for _, cached, _ in on)
    sched = engine.scheduler
    assert sched.allocator.num_free == sched.allocator.num_pages and not sched.has_work()


def test_pages_filled_with_nan_never_reach_an_output(engine):
    with switches(engine, prefix_cache=True):
        reference = asyncio.run(workload(engine, "ref", logprobs=1))
    with switches(engine, prefix_cache=True, fill=True):
        filled = asyncio.run(workload(engine, "nan", logprobs=1))
        # The fill really happens: a page handed out now reads back as NaN.
        (page,) = engine.scheduler.allocator.allocate(1)
        engine.runner.fill_pages(engine.scheduler.allocator.take_fresh())
        assert np.isnan(np.asarray(from_stored(engine.runner.cache.k[:, page]), np.float32)).all()
        engine.scheduler.allocator.free([page])
    assert [tokens for tokens, _, _ in filled] == [tokens for tokens, _, _ in reference]
    for tokens, _, lps in filled:
        for sample_tokens, values in zip(tokens, lps, strict=True):
            assert len(values) == len(sample_tokens)
            assert all(math.isfinite(v) for v in values)
