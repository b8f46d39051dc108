"""A tiny Qwen3-VL model and a tiny multimodal Qwen3.5 (hybrid: linear-attention layers with
state slots beside full-attention ones) through the whole engine: greedy tokens equal HF's ``generate`` with
images of different sizes while prompts are prefilled in chunks that cut through the images
(their tokens attend causally) and decode runs four steps per call (the multimodal rope's
positions advance on the device); prompts with images share steps; the processor's prompt
expansion is what the engine finds again; image traffic compiles nothing after startup; a
preempted sequence is recomputed with the image tokens and positions it had."""

from __future__ import annotations

import pytest

from jax_llm_runtime.runtime.multimodal.inputs import ImageInput
from tests.models import qwen3_vl_vision_fixture as fx
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


def _config(folder, **overrides):
    from jax_llm_runtime.runtime.config import EngineConfig

    settings = dict(
        model_id=str(folder), max_num_seqs=2, max_model_len=256, dtype="float32",
        page_size=PAGE_SIZE, prefill_chunk_size=PAGE_SIZE, max_num_batched_tokens=12,
        decode_steps=4, kvcache_mem_mb=4,
    )  # fmt: skip
    return EngineConfig(**(settings | overrides))


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def served(request):
    from jax_llm_runtime.runtime.loading.builder import build_engine

    folder, hf_model = request.getfixturevalue(f"{request.param}_vision_checkpoint")
    engine = build_engine(_config(folder))
    engine.start()
    yield engine, hf_model
    engine.shutdown()


def _grid(image: ImageInput) -> tuple[int, int, int]:
    return (1, *(side // fx.PATCH_SIZE for side in image.pixels.shape[1:]))


def _prompt(images: tuple[ImageInput, ...], text: bytes = b"describe:") -> list[int]:
    ids = [fx.IM_START_ID, *b"user\n", *text]
    for image in images:
        ids += fx.image_ids(_grid(image)) + list(b"ok")
    return ids


def test_greedy_matches_hf_with_chunked_prefill(served, monkeypatch) -> None:
    engine, hf_model = served
    chunk_ends: list[int] = []
    dispatch = engine.runner.dispatch

    def recording(batch, fed=None):
        chunk_ends.extend(i.start + i.length for i in batch.items if i.length > 1)
        return dispatch(batch, fed)

    monkeypatch.setattr(engine.runner, "dispatch", recording)
    for num_images in (1, 2):
        images = random_images(num_images, seed=10 + num_images)
        inputs = preprocess(engine, images)
        ids = _prompt(inputs)
        chunk_ends.clear()
        tokens, _ = greedy(engine, ids, inputs, f"greedy-{num_images}", NEW_TOKENS)
        assert tokens == fx.hf_greedy(hf_model, ids, images, NEW_TOKENS)
        spans = engine.image_processor.locate(ids, inputs).spans
        assert any(a < end < b for end in chunk_ends for a, b in spans)  # a chunk cut an image


def test_concurrent_prompts_with_images(served) -> None:
    engine, hf_model = served
    images = [random_images(n, seed=50 + n) for n in (1, 2)]
    inputs = [preprocess(engine, group) for group in images]
    prompts = [_prompt(inputs[0], b"first:"), _prompt(inputs[1], b"second, longer:")]
    got = greedy_together(engine, prompts, inputs, NEW_TOKENS)
    for ids, group, tokens in zip(prompts, images, got, strict=True):
        assert tokens == fx.hf_greedy(hf_model, ids, group, NEW_TOKENS)


def test_processor_expansion_is_found_again(served) -> None:
    engine, _ = served
    processor = engine.image_processor
    inputs = preprocess(engine, random_images(2, seed=7))
    placeholder = f"{fx.VISION_START}{fx.IMAGE_PAD}{fx.VISION_END}"
    text = processor.expand(f"{fx.IM_START}{placeholder}{placeholder}", inputs)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert ids == [fx.IM_START_ID, *(t for i in inputs for t in fx.image_ids(_grid(i)))]
    located = processor.locate(ids, inputs)
    assert located is not None and not located.bidirectional
    merged = tuple((h // fx.MERGE, w // fx.MERGE) for _, h, w in map(_grid, inputs))
    assert located.grids == merged
    assert located.grids[0] != located.grids[1]


def test_image_traffic_compiles_nothing_after_startup(served) -> None:
    engine, _ = served
    inputs = [preprocess(engine, random_images(n, seed=40 + n)) for n in (1, 3)]
    assert image_traffic_compiles(engine, [(_prompt(i), i) for i in inputs]) == []


def test_preemption_recomputes_with_the_same_images(qwen3_vl_vision_checkpoint) -> None:
    from jax_llm_runtime.runtime.loading.builder import build_engine

    folder, hf_model = qwen3_vl_vision_checkpoint
    engine = build_engine(_config(folder, prefix_cache=False, decode_steps=1))  # driven here
    images = random_images(2, seed=30)
    inputs = preprocess(engine, images)
    ids = _prompt(inputs)
    located = engine.image_processor.locate(ids, inputs)
    tokens, preemptions, encoded = greedy_preempted_once(engine, ids, located, NEW_TOKENS)
    assert preemptions == 1 and encoded == [2]
    assert tokens == fx.hf_greedy(hf_model, ids, images, NEW_TOKENS)


def test_images_of_two_requests_are_encoded_together(qwen3_vl_vision_checkpoint) -> None:
    """Two prompts whose first chunks reach their images in one step: the encoder runs once,
    for the three images of both (packed together), and each request still gets HF's tokens."""
    from jax_llm_runtime.runtime.engine.request import SamplingParams
    from jax_llm_runtime.runtime.engine.sequence import Sequence, SequenceStatus
    from jax_llm_runtime.runtime.loading.builder import build_engine

    folder, hf_model = qwen3_vl_vision_checkpoint
    engine = build_engine(_config(folder, prefix_cache=False, decode_steps=1))  # driven here
    scheduler, runner = engine.scheduler, engine.runner
    encoded: list[int] = []
    encode = runner.images.encode
    runner.images.encode = lambda images: encoded.append(len(images)) or encode(images)
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    groups = [random_images(n, seed=60 + n) for n in (1, 2)]
    seqs, prompts = [], []
    for i, group in enumerate(groups):
        inputs = preprocess(engine, group)
        ids = [fx.IM_START_ID, *fx.image_ids(_grid(inputs[0]))]  # an image from the start
        for image in inputs[1:]:
            ids += list(b"and") + fx.image_ids(_grid(image))
        prompts.append(ids)
        located = engine.image_processor.locate(ids, inputs)
        seqs.append(Sequence(f"s{i}", ids, sampling, 0, 1, images=located))
        scheduler.add(seqs[-1])
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        batch = scheduler.schedule()
        scheduler.update(batch, runner.run(batch).token_ids)
    assert encoded == [3]
    for seq, ids, group in zip(seqs, prompts, groups, strict=True):
        assert seq.output_ids == fx.hf_greedy(hf_model, ids, group, NEW_TOKENS)
