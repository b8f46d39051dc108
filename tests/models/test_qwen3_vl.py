"""Qwen3-VL and multimodal Qwen3.5 with images against HF ``Qwen3VLForConditionalGeneration``
and ``Qwen3_5ForConditionalGeneration``: last-position logits of prompts with one and two
images of different sizes, whose ``<|image_pad|>`` tokens take the encoder's tokens, whose
first layers add its deepstack levels (Qwen3-VL) and whose rope turns with (temporal, height,
width) positions (Qwen3.5: in its full-attention layers, over half their features, beside
linear-attention layers), over shuffled pages holding garbage; and a text-only prompt, where
the multimodal rope is the plain one."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jax_llm_runtime.models.layers.linear_attention import HybridCache
from jax_llm_runtime.models.registry import get_model_spec
from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput, SequenceImages
from tests.models import qwen3_vl_vision_fixture as fx
from tests.models.gemma3_vision_fixture import random_images
from tests.models.harness import prompt_batch

PAGE_SIZE = 4
PADDED = 192  # the prompts' rows, padded
NUM_PATCHES = 448  # the encoder's run, padded


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def loaded(request):
    folder, hf_model = request.getfixturevalue(f"{request.param}_vision_checkpoint")
    checkpoint = load_hf_checkpoint(Path(folder))
    spec = get_model_spec(checkpoint.config["architectures"][0])
    config = spec.config_from_hf(checkpoint.config)
    vision_config = spec.vision.config_from_hf(checkpoint.config)
    captured: dict[str, np.ndarray] = {}
    text = spec.vision.split_tensors(checkpoint.tensors(), captured)
    weights = spec.load(config, text, np.float32, None)
    vision = spec.vision.load(vision_config, captured, np.float32)
    forward = jax.jit(spec.forward, static_argnums=0)
    encode = jax.jit(spec.vision.encode, static_argnums=0)
    return spec, config, weights, vision_config, vision, forward, encode, hf_model


def _prompt(grids: np.ndarray) -> list[int]:
    ids = [fx.IM_START_ID, *b"user\ndescribe:"]
    for i, grid in enumerate(grids):
        ids += fx.image_ids(grid) + list(b"and" if i + 1 < len(grids) else b"?")
    return ids


def _our_logits(loaded, ids: list[int], images: list, *, deepstack=True, mrope=True):
    """Last-position logits of one prompt chunk padded to ``PADDED`` rows; ``deepstack`` False
    drops the encoder's deepstack levels, ``mrope`` False gives every token plain positions."""
    spec, config, weights, vision_config, vision, forward, encode, _ = loaded
    pixels = fx.hf_pixels(images)
    packed = spec.vision.pack(vision_config, pixels, NUM_PATCHES)
    out = np.asarray(
        encode(vision_config, vision, packed.patches, packed.positions, packed.segments)
    )
    soft = out[: sum(packed.tokens)]
    if not deepstack:
        soft = soft[:, : config.hidden_size]
    rows = np.zeros(PADDED, bool)
    rows[: len(ids)] = np.asarray(ids) == fx.IMAGE_PAD_ID
    embeds = np.zeros((PADDED, soft.shape[1]), np.float32)
    embeds[rows] = soft
    merge = vision_config.spatial_merge_size
    side = fx.PATCH_SIZE * merge
    grids = tuple((p.shape[1] // side, p.shape[2] // side) for p in pixels)
    starts = [i for i, t in enumerate(ids) if t == fx.IMAGE_PAD_ID and ids[i - 1] != t]
    spans = tuple((a, a + r * c) for a, (r, c) in zip(starts, grids, strict=True))
    inputs = tuple(ImageInput.of(p) for p in pixels)
    seq = SequenceImages(inputs, spans, bidirectional=False, grids=grids)
    rope = np.zeros((PADDED, 3), np.int32)
    rope[: len(ids)] = seq.rope_positions(0, len(ids)) if mrope else np.arange(len(ids))[:, None]
    cache, batch = _prompt_batch(config, ids)
    batch = batch.replace(embeds=embeds, embed_rows=rows, rope_positions=rope)
    logits, _ = forward(config, weights, cache, batch)
    return np.asarray(logits)[0]


def _prompt_batch(config, ids: list[int]):
    """``harness.prompt_batch``, with zeroed state slots for a hybrid model's linear layers."""
    cache, batch = prompt_batch(config, ids, PADDED, PAGE_SIZE)
    linear = getattr(config, "linear_attention", None)
    if linear is not None:
        conv, rec = linear.state_shapes(config.num_linear_layers, 1)
        cache = HybridCache(cache, np.zeros(conv, np.float32), np.zeros(rec, np.float32))
    return cache, batch


def test_config_has_interleaved_mrope(loaded) -> None:
    rope = loaded[1].attention.rope
    assert rope.mrope_section in ((2, 3, 3), (1, 2, 1)) and rope.mrope_interleaved


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_hf(loaded, num_images: int) -> None:
    hf_model = loaded[-1]
    images = fx.resized(random_images(num_images, seed=num_images))
    _, grids = fx.hf_patches(images)
    if num_images == 2:
        assert tuple(grids[0]) != tuple(grids[1])
    ids = _prompt(grids)
    ours = _our_logits(loaded, ids, images)
    np.testing.assert_allclose(ours, fx.hf_logits(hf_model, ids, images), atol=1e-4, rtol=0)
    # Each part matters: without the deepstack levels, or with plain positions, the logits
    # differ from HF's.
    levels = loaded[3].deepstack_levels
    assert levels == (0 if loaded[0].hf_architecture.startswith("Qwen3_5") else 2)
    for part in ({"deepstack": False}, {"mrope": False})[0 if levels else 1 :]:
        assert not np.allclose(ours, _our_logits(loaded, ids, images, **part), atol=1e-3), part


def test_text_only_logits_match_hf(loaded) -> None:
    _, config, weights, *_, forward, _, hf_model = loaded
    ids = [fx.IM_START_ID, *b"user\nhello there, how are you?"]
    cache, batch = _prompt_batch(config, ids)
    logits, _ = forward(config, weights, cache, batch)  # no rope_positions: plain positions
    want = fx.hf_logits(hf_model, ids, [])
    np.testing.assert_allclose(np.asarray(logits)[0], want, atol=1e-4, rtol=0)


def test_moe_released_expert_layout_loads_the_same_weights(
    qwen3_vl_moe_vision_checkpoint, tmp_path
):
    """Qwen3-VL-MoE's released checkpoints store ``gate_up_proj`` ``[experts, hidden, 2 *
    inter]`` and ``down_proj`` ``[experts, inter, hidden]``, transposed from transformers 5's
    layout (what ``save_pretrained`` wrote here): both load to the same arrays."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder, _ = qwen3_vl_moe_vision_checkpoint
    released = tmp_path / "released"
    shutil.copytree(folder, released)
    (path,) = released.glob("*.safetensors")
    tensors = load_file(path)
    stacks = [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacks) == 4
    for name in stacks:
        tensors[name] = np.ascontiguousarray(np.swapaxes(tensors[name], 1, 2))
    save_file(tensors, path, metadata={"format": "pt"})

    def text_weights(where: Path):
        checkpoint = load_hf_checkpoint(where)
        spec = get_model_spec(checkpoint.config["architectures"][0])
        config = spec.config_from_hf(checkpoint.config)
        text = spec.vision.split_tensors(checkpoint.tensors(), {})
        return spec.load(config, text, np.float32, None).state

    ours, theirs = text_weights(Path(folder)), text_weights(released)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
