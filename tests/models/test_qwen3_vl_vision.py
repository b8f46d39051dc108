"""Qwen3-VL's image encoder against HF ``Qwen3VLForConditionalGeneration``'s ``model.visual``:
``pack`` against HF's image processor, the image tokens and every deepstack level's for images
of different sizes (packed into one run with padding, and alone), and strict loading."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jax_llm_runtime.models.families import qwen3_vl_vision as qv
from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
from tests.models import qwen3_vl_vision_fixture as fx
from tests.models.gemma3_vision_fixture import random_images
from tests.models.harness import check_vision_loading_is_strict

NUM_PATCHES = 320  # the run of every call here, padded
SPEC = SimpleNamespace(vision=qv.QWEN3_VL_VISION)


@pytest.fixture(scope="module")
def saved(qwen3_vl_vision_checkpoint) -> tuple[Path, object]:
    return qwen3_vl_vision_checkpoint


@pytest.fixture(scope="module")
def images() -> list:
    """Two images HF resizes to different sizes (24 x 40 and 64 x 48 pixels), resized."""
    return fx.resized(random_images(2))


def _load(folder: Path) -> tuple[qv.Qwen3VLVisionConfig, object]:
    checkpoint = load_hf_checkpoint(folder)
    cfg = qv.qwen3_vl_vision_config_from_hf(checkpoint.config)
    captured: dict[str, np.ndarray] = {}
    list(qv.QWEN3_VL_VISION.split_tensors(checkpoint.tensors(), captured))
    return cfg, qv.load(cfg, captured, np.float32)


def _encode(cfg, weights, pixels: list[np.ndarray]) -> list[np.ndarray]:
    packed = qv.pack(cfg, pixels, NUM_PATCHES)
    out = np.asarray(
        jax.jit(qv.encode, static_argnums=0)(
            cfg, weights, packed.patches, packed.positions, packed.segments
        )
    )
    assert out.shape == (NUM_PATCHES // cfg.patch_multiple, cfg.out_width)
    ends = np.cumsum(packed.tokens)
    return [out[end - n : end] for n, end in zip(packed.tokens, ends, strict=True)]


def test_config() -> None:
    cfg = qv.qwen3_vl_vision_config_from_hf(fx.hf_config().to_dict())
    assert (cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size) == (4, 2, 2)
    assert (cfg.patch_multiple, cfg.patch_features, cfg.position_width) == (4, 96, 4)
    assert (cfg.deepstack_levels, cfg.text_hidden_size, cfg.out_width) == (2, 64, 192)
    assert cfg.image_token_id == fx.IMAGE_PAD_ID
    assert cfg.num_patches(24, 40) == 60


def test_canonical_names() -> None:
    for name in ("model.visual.blocks.0.attn.qkv.weight", "lm_head.weight"):
        assert qv.canonical_name(name) == name
    for doubled in ("model.language_model.model.", "language_model.model.model."):
        assert qv.canonical_name(doubled + "norm.weight") == "model.language_model.norm.weight"


def test_pack_matches_hf_processor(images) -> None:
    import torch
    from transformers.vision_utils import get_vision_position_ids

    pixels = fx.hf_pixels(images)
    assert len({p.shape for p in pixels}) == 2
    patches, grid_thw = fx.hf_patches(images)
    cfg = qv.qwen3_vl_vision_config_from_hf(fx.hf_config().to_dict())
    packed = qv.pack(cfg, pixels, NUM_PATCHES)
    used = len(patches)
    np.testing.assert_array_equal(packed.patches[:used], patches)
    assert not packed.patches[used:].any() and (packed.segments[used:] == -1).all()
    rope = get_vision_position_ids(torch.from_numpy(grid_thw), fx.MERGE).numpy()
    np.testing.assert_array_equal(packed.positions[:used, :2], rope)
    grids = np.repeat(grid_thw[:, 1:], grid_thw.prod(-1), axis=0)
    np.testing.assert_array_equal(packed.positions[:used, 2:], grids)
    np.testing.assert_array_equal(packed.segments[:used], np.repeat([0, 1], grid_thw.prod(-1)))
    assert packed.tokens == tuple(grid_thw.prod(-1) // cfg.patch_multiple)


def test_encoder_matches_hf(saved, images) -> None:
    folder, hf_model = saved
    cfg, weights = _load(folder)
    pixels = fx.hf_pixels(images)
    patches, grid_thw = fx.hf_patches(images)
    tokens, levels = fx.hf_encoder(hf_model, patches, grid_thw)
    expected = np.concatenate([tokens, *levels], axis=-1)
    assert len(levels) == cfg.deepstack_levels
    ends = np.cumsum(grid_thw.prod(-1) // cfg.patch_multiple)
    per_image = np.split(expected, ends[:-1])
    packed = _encode(cfg, weights, pixels)  # one run, attention within each image
    for ours, ref in zip(packed, per_image, strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    (alone,) = _encode(cfg, weights, pixels[1:])  # alone, padding masked
    np.testing.assert_allclose(alone, per_image[1], atol=1e-5, rtol=0)
    # The levels are distinct outputs, not copies of the image tokens.
    width = cfg.text_hidden_size
    assert not np.allclose(expected[:, :width], expected[:, width : 2 * width], atol=1e-2)


def test_vision_loading_is_strict(saved) -> None:
    folder, _ = saved
    cfg, _ = _load(folder)
    check_vision_loading_is_strict(
        SPEC,
        cfg,
        folder,
        missing="model.visual.deepstack_merger_list.1.linear_fc2.bias",
        extra="model.visual.blocks.0.attn.q_norm.weight",
        reshaped="model.visual.patch_embed.proj.weight",
    )
