"""Mistral 3 with images against HF ``Mistral3ForConditionalGeneration``: the encoder's soft
tokens for images of different sizes (packed into one run, alone in a padded run, the padding
masked), and last-position logits of prompts with one and two images of different sizes, whose
``[IMG]`` tokens take the soft tokens and attend causally, over shuffled pages holding garbage."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jax_llm_runtime.models.registry import get_model_spec
from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
from tests.models import mistral3_vision_fixture as fx
from tests.models.gemma3_vision_fixture import random_images
from tests.models.harness import check_vision_loading_is_strict, prompt_batch

PAGE_SIZE = 4
PADDED = 96  # the prompts' rows, padded
ARCH = "Mistral3ForConditionalGeneration"


@pytest.fixture(scope="module")
def saved(mistral3_vision_checkpoint) -> tuple[Path, object]:
    return mistral3_vision_checkpoint


def _load(folder: Path):
    checkpoint = load_hf_checkpoint(folder)
    spec = get_model_spec(ARCH)
    config = spec.config_from_hf(checkpoint.config)
    vision_config = spec.vision.config_from_hf(checkpoint.config)
    captured: dict[str, np.ndarray] = {}
    text = spec.vision.split_tensors(checkpoint.tensors(), captured)
    weights = spec.load(config, text, np.float32, None)
    vision = spec.vision.load(vision_config, captured, np.float32)
    return spec, config, weights, vision_config, vision


_JITTED: dict = {}


def _forward(spec):
    return _JITTED.setdefault(spec.forward, jax.jit(spec.forward, static_argnums=0))


def _encode(spec):
    return _JITTED.setdefault(spec.vision.encode, jax.jit(spec.vision.encode, static_argnums=0))


def _soft_tokens(loaded, pixels: list[np.ndarray], num_patches: int) -> list[np.ndarray]:
    spec, _, _, vision_config, vision = loaded
    packed = spec.vision.pack(vision_config, pixels, num_patches)
    out = np.asarray(
        _encode(spec)(vision_config, vision, packed.patches, packed.positions, packed.segments)
    )
    ends = np.cumsum(packed.tokens)
    return [out[end - n : end] for n, end in zip(packed.tokens, ends, strict=True)]


def _prompt(pixels: list[np.ndarray]) -> list[int]:
    ids = [256, *b"describe:"]
    for i, image in enumerate(pixels):
        ids += fx.image_sequence(image) + list(b"and" if i + 1 < len(pixels) else b"?")
    return ids


def _our_logits(loaded, ids: list[int], pixels: list[np.ndarray], images: bool = True):
    """Last-position logits of one prompt chunk padded to ``PADDED`` rows (one compiled shape
    for every prompt here) over shuffled pages of random garbage; ``images`` False leaves the
    ``[IMG]`` tokens' own embeddings."""
    spec, config, weights, _, _ = loaded
    soft = np.concatenate(_soft_tokens(loaded, pixels, 256))
    rows = np.zeros(PADDED, bool)
    rows[: len(ids)] = np.asarray(ids) == fx.IMG_ID
    embeds = np.zeros((PADDED, config.hidden_size), np.float32)
    embeds[rows] = soft
    cache, batch = prompt_batch(config, ids, PADDED, PAGE_SIZE)
    if images:
        batch = batch.replace(embeds=embeds, embed_rows=rows)
    logits, _ = _forward(spec)(config, weights, cache, batch)
    return np.asarray(logits)[0]


def test_encoder_matches_hf(saved) -> None:
    folder, hf_model = saved
    loaded = _load(folder)
    pixels = fx.hf_pixels(random_images(3))
    ref = fx.hf_soft_tokens(hf_model, pixels)
    # Three sizes (24 x 40, 40 x 32, 40 x 24 pixels), of two token counts.
    assert len({p.shape for p in pixels}) == 3 and len({r.shape for r in ref}) == 2
    packed = _soft_tokens(loaded, pixels, 256)  # one run, block-diagonal attention
    for ours, expected in zip(packed, ref, strict=True):
        np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    for image, expected in zip(pixels, ref, strict=True):  # alone, padding masked
        (ours,) = _soft_tokens(loaded, [image], 128)
        np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_hf(saved, num_images: int) -> None:
    folder, hf_model = saved
    loaded = _load(folder)
    pixels = fx.hf_pixels(random_images(num_images, seed=num_images))
    if num_images == 2:
        assert pixels[0].shape != pixels[1].shape
    ids = _prompt(pixels)
    ours = _our_logits(loaded, ids, pixels)
    np.testing.assert_allclose(ours, fx.hf_logits(hf_model, ids, pixels), atol=1e-4, rtol=0)
    # The soft tokens matter: the [IMG] tokens' own embeddings give other logits.
    assert not np.allclose(ours, _our_logits(loaded, ids, pixels, images=False), atol=1e-3)


def test_vision_loading_is_strict(saved) -> None:
    folder, _ = saved
    spec, _, _, vision_config, _ = _load(folder)
    captured: dict[str, np.ndarray] = {}
    list(spec.vision.split_tensors(load_hf_checkpoint(folder).tensors(), captured))
    assert "model.vision_tower.ln_pre.weight" in captured
    check_vision_loading_is_strict(
        spec,
        vision_config,
        folder,
        missing="model.multi_modal_projector.patch_merger.merging_layer.weight",
        extra="model.vision_tower.ln_post.weight",
        reshaped="model.multi_modal_projector.linear_1.weight",
    )
