"""Gemma 3 with images against HF ``Gemma3ForConditionalGeneration``: the encoder's soft
tokens, and last-position logits of prompts with one and two images, where the image tokens
attend to each other both ways (``StepBatch.horizons``) over shuffled pages holding garbage."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jax_llm_runtime.models.registry import get_model_spec
from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
from tests.models import gemma3_vision_fixture as fx
from tests.models.harness import check_vision_loading_is_strict, prompt_batch

PAGE_SIZE = 4
PADDED = 64  # the prompts' rows, padded


@pytest.fixture(scope="module")
def saved(gemma3_vision_checkpoint) -> tuple[Path, object]:
    return gemma3_vision_checkpoint


def _load(folder: Path):
    checkpoint = load_hf_checkpoint(folder)
    spec = get_model_spec("Gemma3ForConditionalGeneration")
    config = spec.config_from_hf(checkpoint.config)
    vision_config = spec.vision.config_from_hf(checkpoint.config)
    captured: dict[str, np.ndarray] = {}
    text = spec.vision.split_tensors(checkpoint.tensors(), captured)
    weights = spec.load(config, text, np.float32, None)
    vision = spec.vision.load(vision_config, captured, np.float32)
    return spec, config, weights, vision_config, vision


def _prompt(num_images: int) -> list[int]:
    ids = [256, *b"describe:"]
    for i in range(num_images):
        ids += fx.image_sequence() + list(b"and" if i + 1 < num_images else b"?")
    return ids


def _our_logits(loaded, ids: list[int], pixels: np.ndarray, both_ways: bool = True) -> np.ndarray:
    """Last-position logits of one prompt chunk padded to ``PADDED`` rows (one compiled shape
    for every prompt here) over shuffled pages of random garbage."""
    spec, config, weights, vision_config, vision = loaded
    soft = np.asarray(_encode(spec)(vision_config, vision, pixels))  # [n, tokens, hidden]
    rows = np.zeros(PADDED, bool)
    rows[: len(ids)] = np.asarray(ids) == fx.IMAGE_ID
    embeds = np.zeros((PADDED, config.hidden_size), np.float32)
    embeds[rows] = soft.reshape(-1, config.hidden_size)
    horizons = np.arange(PADDED, dtype=np.int32)
    for start in np.flatnonzero(rows & ~np.roll(rows, 1)):
        horizons[start : start + fx.TOKENS_PER_IMAGE] = start + fx.TOKENS_PER_IMAGE - 1
    cache, batch = prompt_batch(config, ids, PADDED, PAGE_SIZE)
    batch = batch.replace(embeds=embeds, embed_rows=rows, horizons=horizons if both_ways else None)
    logits, _ = _forward(spec)(config, weights, cache, batch)
    return np.asarray(logits)[0]


_JITTED: dict = {}


def _forward(spec):
    return _JITTED.setdefault(spec.forward, jax.jit(spec.forward, static_argnums=0))


def _encode(spec):
    return _JITTED.setdefault(spec.vision.encode, jax.jit(spec.vision.encode, static_argnums=0))


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_hf(saved, num_images: int) -> None:
    folder, hf_model = saved
    loaded = _load(folder)
    images = fx.random_images(num_images, seed=num_images)
    pixels = fx.hf_pixels(images)
    ids = _prompt(num_images)
    ours = _our_logits(loaded, ids, pixels)
    ref = fx.hf_logits(hf_model, ids, pixels)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    # The image tokens' two-way attention matters: causal attention gives other logits.
    assert not np.allclose(ours, _our_logits(loaded, ids, pixels, both_ways=False), atol=1e-3)


def test_window_narrower_than_an_image(tmp_path: Path) -> None:
    """Sliding layers whose window (3) is narrower than an image (4 tokens): an image token
    sees the image's later tokens, and its earlier ones only within the window, as HF's mask
    (window AND (causal OR same image)) has it."""
    hf_model = fx.save_model(tmp_path, seed=1, sliding_window=3)
    pixels = fx.hf_pixels(fx.random_images(2, seed=6))
    ids = _prompt(2)
    ours = _our_logits(_load(tmp_path), ids, pixels)
    np.testing.assert_allclose(ours, fx.hf_logits(hf_model, ids, pixels), atol=1e-4, rtol=0)


def test_encoder_matches_hf(saved) -> None:
    import torch

    folder, hf_model = saved
    spec, _, _, vision_config, vision = _load(folder)
    pixels = fx.hf_pixels(fx.random_images(3))
    ours = np.asarray(_encode(spec)(vision_config, vision, pixels))
    with torch.no_grad():
        ref = hf_model.model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    assert ours.shape == (3, fx.TOKENS_PER_IMAGE, 64)
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


def test_vision_loading_is_strict(saved) -> None:
    folder, _ = saved
    spec, _, _, vision_config, _ = _load(folder)
    check_vision_loading_is_strict(
        spec,
        vision_config,
        folder,
        missing="model.multi_modal_projector.mm_soft_emb_norm.weight",
        extra="model.vision_tower.vision_model.head.weight",
        reshaped="model.multi_modal_projector.mm_input_projection_weight",
    )
