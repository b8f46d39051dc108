"""A tiny Gemma 3 vision-language model through the whole engine: greedy tokens equal HF's
``generate`` with the same images while prompts are prefilled in chunks that meet the images;
prompts alike but for their images share no prefix-cache page of an image, and the same image
again does; text prompts still run; a prompt whose image tokens do not match its images is
refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jax_llm_runtime.runtime.multimodal.inputs import ImageInput
from tests.models import gemma3_vision_fixture as fx
from tests.runtime.image_requests import (
    greedy,
    greedy_preempted_once,
    greedy_together,
    image_traffic_compiles,
    preprocess,
)

NEW_TOKENS = 8
PAGE_SIZE = 8


@pytest.fixture(scope="module")
def saved(gemma3_vision_checkpoint):
    return gemma3_vision_checkpoint


def _config(folder: Path, **changes):
    from jax_llm_runtime.runtime.config import EngineConfig

    settings = dict(
        model_id=str(folder), max_num_seqs=2, max_model_len=96, dtype="float32",
        page_size=PAGE_SIZE, prefill_chunk_size=PAGE_SIZE, max_num_batched_tokens=12,
        decode_steps=1, kvcache_mem_mb=1,
    )  # fmt: skip
    return EngineConfig(**(settings | changes))


@pytest.fixture(scope="module")
def served(saved):
    from jax_llm_runtime.runtime.loading.builder import build_engine

    folder, hf_model = saved
    engine = build_engine(_config(folder))
    engine.start()
    yield engine, hf_model
    engine.shutdown()


def _prompt(num_images: int, text: bytes = b"describe:") -> list[int]:
    ids = [256, *text]
    for _ in range(num_images):
        ids += fx.image_sequence() + list(b"ok")
    return ids


def _run(engine, ids: list[int], images: tuple[ImageInput, ...], rid: str):
    return greedy(engine, ids, images, rid, NEW_TOKENS)


def _hf_greedy(hf_model, ids: list[int], pixels: np.ndarray) -> list[int]:
    return fx.hf_greedy(hf_model, ids, pixels, NEW_TOKENS)


_inputs = preprocess


def test_greedy_matches_hf_with_chunked_prefill(served) -> None:
    engine, hf_model = served
    for num_images in (1, 2):
        images = fx.random_images(num_images, seed=10 + num_images)
        inputs = _inputs(engine, images)
        ids = _prompt(num_images)
        got, _ = _run(engine, ids, inputs, f"greedy-{num_images}")
        pixels = np.stack([i.pixels for i in inputs])
        assert got == _hf_greedy(hf_model, ids, pixels)


def test_concurrent_prompts_with_images(served) -> None:
    """Prompts with different images at once: their chunks share steps with each other's
    decode rows (mixed steps where the CPU's ragged attention allows them), and each gets
    HF's greedy tokens."""
    engine, hf_model = served
    inputs = [_inputs(engine, fx.random_images(n, seed=50 + n)) for n in (1, 2)]
    prompts = [_prompt(1, b"first:"), _prompt(2, b"second, longer:")]

    got = greedy_together(engine, prompts, inputs, NEW_TOKENS)
    for ids, images, tokens in zip(prompts, inputs, got, strict=True):
        pixels = np.stack([image.pixels for image in images])
        assert tokens == _hf_greedy(hf_model, ids, pixels)


def test_prefix_cache_keys_include_images(served) -> None:
    engine, hf_model = served
    first, second = (_inputs(engine, fx.random_images(1, seed=s)) for s in (20, 21))
    ids = _prompt(1, b"a longer prefix of text:")  # its image starts at position 27
    image_start = ids.index(fx.IMAGE_ID)
    a, _ = _run(engine, ids, first, "cache-a")
    b, cached_b = _run(engine, ids, second, "cache-b")
    # Only the pages before the image are shared.
    assert cached_b == image_start // PAGE_SIZE * PAGE_SIZE
    again, cached_again = _run(engine, ids, first, "cache-a-again")
    assert cached_again >= image_start + fx.TOKENS_PER_IMAGE  # the image's pages too
    assert again == a
    assert b == _hf_greedy(hf_model, ids, second[0].pixels[None])


def test_image_traffic_compiles_nothing_after_startup(served) -> None:
    """The image encoder's batch sizes and the steps that prefill image tokens are compiled
    with the other buckets, before serving traffic needs them."""
    engine, _ = served
    requests = [(_prompt(n), _inputs(engine, fx.random_images(n, seed=40 + n))) for n in (1, 2)]
    assert image_traffic_compiles(engine, requests) == []


def test_text_prompts_and_mismatched_images(served) -> None:
    engine, _ = served
    text, _ = _run(engine, [256, *b"just text"], (), "text")
    assert len(text) == NEW_TOKENS
    images = _inputs(engine, fx.random_images(2))
    with pytest.raises(ValueError, match="image"):
        _run(engine, _prompt(1), images, "mismatch")
    with pytest.raises(ValueError, match="image tokens in a row"):
        _run(engine, [256, fx.IMAGE_ID, 65], (), "stray")


def test_preemption_recomputes_with_the_same_image(saved) -> None:
    """A sequence preempted after its image was prefilled is recomputed from its tokens (no
    prefix cache here, so the image's tokens too) with the soft tokens it kept: the encoder runs
    once, and the greedy tokens are HF's."""
    from jax_llm_runtime.runtime.loading.builder import build_engine
    from jax_llm_runtime.runtime.multimodal.inputs import SequenceImages, image_spans

    folder, hf_model = saved
    engine = build_engine(_config(folder, prefix_cache=False))  # driven here, not started
    inputs = _inputs(engine, fx.random_images(1, seed=30))
    ids = _prompt(1)
    spans = image_spans(ids, fx.IMAGE_ID, fx.TOKENS_PER_IMAGE)
    images = SequenceImages(inputs, tuple(spans))
    tokens, preemptions, encoded = greedy_preempted_once(engine, ids, images, NEW_TOKENS)
    assert preemptions == 1 and encoded == [1]
    assert tokens == _hf_greedy(hf_model, ids, inputs[0].pixels[None])
