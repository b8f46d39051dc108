"""After startup (and its background compilation), a day of mixed traffic compiles nothing:
every step, embedding and prompt-scoring call lands in a bucket compiled ahead of time.

"Compiles" means any jit trace, lowering or backend compilation JAX reports through
``jax.monitoring``, so an eager jnp op sneaking into the loop would be caught too.
"""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

from jax_llm_runtime.runtime.engine.request import SamplingParams

pytestmark = pytest.mark.slow


async def _traffic(engine, rng: np.random.Generator) -> int:
    """Waves of concurrent requests with varied prompt lengths, budgets and sampling."""
    limit = engine.max_model_len

    async def generate(i: int) -> int:
        length = int(rng.integers(1, limit // 2))
        ids = rng.integers(100, 40000, length).tolist()
        sampling = SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.2])),
            top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([0, 20])),
            max_tokens=int(rng.integers(1, 40)),
            seed=int(rng.integers(0, 2**31)) if i % 3 == 0 else None,
            logprobs=int(rng.integers(0, 5)) if i % 4 == 0 else None,
            presence_penalty=0.5 if i % 5 == 0 else 0.0,
            repetition_penalty=1.2 if i % 7 == 0 else 1.0,
            logit_bias=((int(rng.integers(0, 1000)), 5.0),) if i % 6 == 0 else (),
        )
        if i % 8 == 0:
            streams = engine.generate_n(ids, sampling, f"day-{i}", n=2)
        else:
            streams = [engine.generate(ids, sampling, f"day-{i}")]
        count = 0
        for stream in streams:
            async for delta in stream:
                count += len(delta.token_ids)
        return count

    total = 0
    request = 0
    for concurrency in (1, 3, 8, 5, 2, 8):
        batch = [generate(request + j) for j in range(concurrency)]
        request += concurrency
        total += sum(await asyncio.gather(*batch))
        lengths = [int(n) for n in rng.integers(1, limit, 3)]
        inputs = [rng.integers(100, 40000, n).tolist() for n in lengths]
        await engine.embed(inputs, "mean")
        await engine.prompt_logprobs(inputs[0], 3)
    return total


def test_mixed_traffic_compiles_nothing(smollm2_engine):
    assert smollm2_engine.compile_done.wait(timeout=900), "background compilation did not finish"
    events: list[str] = []

    def listener(event: str, *_args, **_kwargs) -> None:
        if event.startswith("/jax/core/compile/") or "compilation_cache" in event:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        tokens = asyncio.run(_traffic(smollm2_engine, np.random.default_rng(0)))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert tokens > 100
    assert events == []
