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
