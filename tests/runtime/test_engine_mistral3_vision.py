"""A tiny Mistral 3 vision-language model through the whole engine: greedy tokens equal HF's
``generate`` with images of different sizes while prompts are prefilled in chunks that cut
through the images (their tokens attend causally, so a chunk may end inside one); image traffic
compiles nothing after startup (the encoder's packed patch counts are compiled buckets); the
processor's pixels and prompt expansion are what the engine expects; the prefix cache tells
images apart; a preempted sequence is recomputed with the soft tokens it kept; a prompt whose
image tokens do not match its images is refused."""

from __future__ import annotations

import numpy as np
import pytest

from jax_llm_runtime.runtime.multimodal.inputs import ImageInput
from tests.models import mistral3_vision_fixture as fx
from tests.models.gemma3_vision_fixture import random_images
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
def served(mistral3_vision_checkpoint):
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    folder, hf_model = mistral3_vision_checkpoint
    config = EngineConfig(
        model_id=str(folder), max_num_seqs=2, max_model_len=128, dtype="float32",
        page_size=PAGE_SIZE, prefill_chunk_size=PAGE_SIZE, max_num_batched_tokens=12,
        decode_steps=1, kvcache_mem_mb=1,
    )  # fmt: skip
    engine = build_engine(config)
    engine.start()
    yield engine, hf_model
    engine.shutdown()


def _prompt(images: tuple[ImageInput, ...], text: bytes = b"describe:") -> list[int]:
    ids = [256, *text]
    for image in images:
        ids += fx.image_sequence(image.pixels) + list(b"ok")
    return ids


def _run(engine, ids: list[int], images: tuple[ImageInput, ...], rid: str) -> list[int]:
    return greedy(engine, ids, images, rid, NEW_TOKENS)[0]


_inputs = preprocess


def _hf_greedy(hf_model, ids: list[int], images: tuple[ImageInput, ...]) -> list[int]:
    return fx.hf_greedy(hf_model, ids, [image.pixels for image in images], NEW_TOKENS)


def test_greedy_matches_hf_with_chunked_prefill(served, monkeypatch) -> None:
    engine, hf_model = served
    chunk_ends: list[int] = []
    dispatch = engine.runner.dispatch

    def recording(batch, fed=None):
        chunk_ends.extend(i.start + i.length for i in batch.items if i.length > 1)
        return dispatch(batch, fed)

    monkeypatch.setattr(engine.runner, "dispatch", recording)
    for num_images in (1, 2):
        inputs = _inputs(engine, random_images(num_images, seed=10 + num_images))
        ids = _prompt(inputs)
        chunk_ends.clear()
        assert _run(engine, ids, inputs, f"greedy-{num_images}") == _hf_greedy(
            hf_model, ids, inputs
        )
        spans = engine.image_processor.locate(ids, inputs).spans
        assert any(a < end < b for end in chunk_ends for a, b in spans)  # a chunk cut an image


def test_concurrent_prompts_with_images(served) -> None:
    """Prompts with different images at once: their chunks share steps with each other's
    decode rows, and each gets HF's greedy tokens."""
    engine, hf_model = served
    inputs = [_inputs(engine, random_images(n, seed=50 + n)) for n in (1, 2)]
    prompts = [_prompt(inputs[0], b"first:"), _prompt(inputs[1], b"second, longer:")]

    got = greedy_together(engine, prompts, inputs, NEW_TOKENS)
    for ids, images, tokens in zip(prompts, inputs, got, strict=True):
        assert tokens == _hf_greedy(hf_model, ids, images)


def test_processor_pixels_and_expansion(served) -> None:
    """The engine's processor makes transformers' pixels, and expands the template's ``[IMG]``
    into the grid of tokens the engine then finds, per image size."""
    engine, _ = served
    processor = engine.image_processor
    images = random_images(4, seed=7)
    inputs = _inputs(engine, images)
    for ours, ref in zip(inputs, fx.hf_pixels(images), strict=True):
        np.testing.assert_allclose(ours.pixels, ref, atol=1e-6, rtol=0)
    text = processor.expand("<s>[IMG][IMG]", inputs[:2])  # two images that touch
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    grids = [fx.image_sequence(image.pixels) for image in inputs[:2]]
    assert ids == [256, *grids[0], *grids[1]] and len(grids[0]) != len(grids[1])
    located = processor.locate(ids, inputs[:2])
    assert located is not None and not located.bidirectional
    assert located.spans == ((1, 1 + len(grids[0])), (1 + len(grids[0]), len(ids)))
    with pytest.raises(ValueError, match="placeholders"):
        processor.expand("[IMG]", inputs[:2])


def test_image_traffic_compiles_nothing_after_startup(served) -> None:
    engine, _ = served
    inputs = [_inputs(engine, random_images(n, seed=40 + n)) for n in (1, 3)]
    assert image_traffic_compiles(engine, [(_prompt(i), i) for i in inputs]) == []


def test_text_prompts_and_mismatched_images(served) -> None:
    engine, _ = served
    assert len(_run(engine, [256, *b"just text"], (), "text")) == NEW_TOKENS
    inputs = _inputs(engine, random_images(2))
    with pytest.raises(ValueError, match="image"):
        _run(engine, _prompt(inputs[:1]), inputs, "mismatch")
    swapped = _prompt((inputs[1], inputs[0]))  # the grids of other sizes
    with pytest.raises(ValueError, match="grid"):
        _run(engine, swapped, inputs, "swapped")
    with pytest.raises(ValueError, match="end token"):
        _run(engine, [256, fx.IMG_ID, fx.BREAK_ID, 65], (), "stray")


def test_prefix_cache_keys_include_images(served) -> None:
    """Pages that hold part of an image are keyed by its digest too: a prompt alike but for its
    image shares only the pages before the image; the same image again shares its pages."""
    engine, hf_model = served
    first, second = (_inputs(engine, random_images(1, seed=s)) for s in (20, 21))
    ids = _prompt(first, b"a longer prefix of text:")
    assert ids == _prompt(second, b"a longer prefix of text:")  # images of one size
    image_start = ids.index(fx.IMG_ID)

    a, _ = greedy(engine, ids, first, "cache-a", NEW_TOKENS)
    b, cached_b = greedy(engine, ids, second, "cache-b", NEW_TOKENS)
    assert cached_b == image_start // PAGE_SIZE * PAGE_SIZE
    again, cached_again = greedy(engine, ids, first, "cache-a-again", NEW_TOKENS)
    assert cached_again > image_start + len(fx.image_sequence(first[0].pixels)) - PAGE_SIZE
    assert again == a and b == _hf_greedy(hf_model, ids, second)


def test_preemption_recomputes_with_the_same_images(mistral3_vision_checkpoint) -> None:
    """A sequence preempted after its images were prefilled is recomputed from its tokens (no
    prefix cache here) with the soft tokens it kept: the encoder runs once, and the greedy
    tokens are HF's."""
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    folder, hf_model = mistral3_vision_checkpoint
    config = EngineConfig(
        model_id=str(folder), max_num_seqs=2, max_model_len=128, dtype="float32",
        page_size=PAGE_SIZE, prefill_chunk_size=PAGE_SIZE, max_num_batched_tokens=12,
        decode_steps=1, kvcache_mem_mb=1, prefix_cache=False,
    )  # fmt: skip
    engine = build_engine(config)  # driven here, not started
    inputs = _inputs(engine, random_images(2, seed=30))
    ids = _prompt(inputs)
    images = engine.image_processor.locate(ids, inputs)
    tokens, preemptions, encoded = greedy_preempted_once(engine, ids, images, NEW_TOKENS)
    assert preemptions == 1 and encoded == [2]
    assert tokens == _hf_greedy(hf_model, ids, inputs)
