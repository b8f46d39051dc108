"""The scheduler with images: a prefill chunk never ends inside an image (it stops before it,
or grows to its end, past the budget if need be), and the prefix cache tells pages of
different images apart."""

from __future__ import annotations

import numpy as np

from jax_llm_runtime.runtime.engine.page_allocator import PageAllocator
from jax_llm_runtime.runtime.engine.request import SamplingParams
from jax_llm_runtime.runtime.engine.scheduler import Scheduler
from jax_llm_runtime.runtime.engine.sequence import Sequence
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput, SequenceImages, image_spans

IMAGE, TOKENS = 9, 6


def _seq(rid: str, ids: list[int], pixels: float, arrival: int) -> Sequence:
    spans = image_spans(ids, IMAGE, TOKENS)
    images = tuple(ImageInput.of(np.full((3, 2, 2), pixels)) for _ in spans)
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    return Sequence(rid, ids, sampling, 0, arrival, images=SequenceImages(images, tuple(spans)))


def _scheduler(chunk: int = 4, budget: int = 5) -> Scheduler:
    allocator = PageAllocator(64, 4)
    return Scheduler(allocator, 2, 64, chunk, [0], max_num_batched_tokens=budget, max_step_tokens=8)


def _chunks(scheduler: Scheduler) -> list[tuple[int, int]]:
    """Each step's (start, length) of a lone prompt until it is computed."""
    out = []
    while True:
        batch = scheduler.schedule()
        item = batch.items[0]
        out.append((item.start, item.length))
        done = item.reaches_end
        scheduler.update(batch, [[1]])
        if done:
            return out


def test_chunks_never_cut_an_image() -> None:
    ids = [1, 2, 3, *[IMAGE] * TOKENS, 4, 5, *[IMAGE] * TOKENS, 6]
    scheduler = _scheduler()
    scheduler.add(_seq("a", ids, 0.0, 1))
    chunks = _chunks(scheduler)
    # Before the first image; the image whole (6 tokens, past the chunk of 4 and budget of 5);
    # before the second image; the second image; the rest.
    assert chunks == [(0, 3), (3, 6), (9, 2), (11, 6), (17, 1)]


def test_pages_of_different_images_are_not_shared() -> None:
    ids = [1, 2, 3, 4, *[IMAGE] * TOKENS, 5, 6, 7, 8, 10]
    scheduler = _scheduler(chunk=16, budget=32)
    for rid, pixels, arrival in (("a", 0.0, 1), ("b", 1.0, 2), ("c", 0.0, 3)):
        seq = _seq(rid, ids, pixels, arrival)
        scheduler.add(seq)
        _chunks(scheduler)
        scheduler.abort(rid)
        # The text page before the image is shared; pages from the image's on only for "c",
        # whose image is "a"'s.
        assert seq.num_cached_tokens == {"a": 0, "b": 4, "c": 12}[rid]
