"""Greedy requests with images through a started engine, one or several at once (the image
engine tests of each vision family)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from jax_llm_runtime.runtime.engine.request import SamplingParams
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput


def preprocess(engine: Any, images: Sequence[Any]) -> tuple[ImageInput, ...]:
    """PIL images as the engine's image processor prepares them."""
    return tuple(engine.image_processor.preprocess(image) for image in images)


async def _greedy(
    engine: Any, ids: list[int], images: tuple[ImageInput, ...], rid: str, max_tokens: int
) -> tuple[list[int], int]:
    out, cached = [], 0
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async for delta in engine.generate(ids, sampling, rid, images):
        out += delta.token_ids
        cached = delta.num_cached_tokens
    return out, cached


def greedy(
    engine: Any, ids: list[int], images: tuple[ImageInput, ...], rid: str, max_tokens: int
) -> tuple[list[int], int]:
    """One request's greedy tokens and how many of its prompt tokens the prefix cache held."""
    return asyncio.run(_greedy(engine, ids, images, rid, max_tokens))


def greedy_together(
    engine: Any,
    prompts: Sequence[list[int]],
    inputs: Sequence[tuple[ImageInput, ...]],
    max_tokens: int,
) -> list[list[int]]:
    """The greedy tokens of several requests sent at once (their steps mix)."""

    async def run() -> list[tuple[list[int], int]]:
        jobs = (
            _greedy(engine, ids, images, f"together-{i}", max_tokens)
            for i, (ids, images) in enumerate(zip(prompts, inputs, strict=True))
        )
        return await asyncio.gather(*jobs)

    return [tokens for tokens, _ in asyncio.run(run())]


def image_traffic_compiles(engine: Any, requests: Sequence[tuple[list[int], tuple]]) -> list[str]:
    """The JAX compile events while a started engine (its startup compiles done) serves each
    (prompt ids, images) request greedily; none is expected."""
    import jax

    assert engine.compile_done.wait(timeout=300)
    events: list[str] = []

    def listener(event: str, *_args: Any, **_kwargs: Any) -> None:
        if event.startswith("/jax/core/compile/") or "compilation_cache" in event:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for i, (ids, images) in enumerate(requests):
            greedy(engine, ids, images, f"no-compile-{i}", 4)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return events


def greedy_preempted_once(engine: Any, ids: list[int], images: Any, max_tokens: int) -> tuple:
    """Drive an engine that was built and not started through one greedy sequence of ``ids``
    with ``images`` (its ``SequenceImages``), preempting it once after its second token;
    returns (its tokens, its preemptions, the image counts the encoder ran for)."""
    from jax_llm_runtime.runtime.engine.sequence import Sequence, SequenceStatus

    scheduler, runner = engine.scheduler, engine.runner
    encoded: list[int] = []
    encode = runner.images.encode
    runner.images.encode = lambda batch: encoded.append(len(batch)) or encode(batch)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence("p", ids, sampling, 0, 1, images=images)
    scheduler.add(seq)
    while seq.status is not SequenceStatus.FINISHED:
        batch = scheduler.schedule()
        scheduler.update(batch, runner.run(batch).token_ids)
        if len(seq.output_ids) == 2 and seq.num_preemptions == 0:
            scheduler._preempt(seq)
    return seq.output_ids, seq.num_preemptions, encoded
