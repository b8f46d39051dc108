"""Multimodal rope (Qwen3-VL): each token's three positions as transformers' ``get_rope_index``
computes them, prompt chunk by chunk and past the prompt, and the rotation they give as
transformers' Qwen3-VL rotary embedding applies it."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_llm_runtime.models.layers.rotary import RopeConfig, apply_rope
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput, SequenceImages

MERGE = 2
PAD = 7  # the image token of the prompts below


def _prompt() -> tuple[list[int], SequenceImages]:
    """Text, a 3 x 5 image, text, a 4 x 2 image touching the next image of 1 x 1, text."""
    grids = ((3, 5), (4, 2), (1, 1))
    ids, spans = [1, 2, 3], []
    for i, (rows, cols) in enumerate(grids):
        start = len(ids)
        ids += [PAD] * (rows * cols)
        spans.append((start, len(ids)))
        ids += [4, 5] if i != 1 else [6]
    images = tuple(ImageInput.of(np.zeros((3, 2, 2), np.float32)) for _ in grids)
    return ids, SequenceImages(images, tuple(spans), bidirectional=False, grids=grids)


def _hf_positions(ids: list[int], grids: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, int]:
    """transformers' positions [3, len] and rope delta of one prompt (no model is built: the
    method reads only its config's merge size)."""
    from transformers import Qwen3VLModel

    owner = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE))
    )
    owner.get_vision_position_ids = lambda *a, **k: Qwen3VLModel.get_vision_position_ids(
        owner, *a, **k
    )
    input_ids = torch.tensor([ids])
    grid_thw = torch.tensor([[1, r * MERGE, c * MERGE] for r, c in grids])
    types = (input_ids == PAD).int()
    positions, deltas = Qwen3VLModel.get_rope_index(
        owner, input_ids, mm_token_type_ids=types, image_grid_thw=grid_thw
    )
    return positions[:, 0].numpy(), int(deltas[0, 0])


def test_positions_match_transformers_whole_and_in_chunks() -> None:
    ids, images = _prompt()
    expected, delta = _hf_positions(ids, images.grids)
    np.testing.assert_array_equal(images.rope_positions(0, len(ids)), expected.T)
    for cut in (2, 5, 9, 20, 26):  # chunks cutting images anywhere give the same rows
        joined = np.concatenate(
            [images.rope_positions(0, cut), images.rope_positions(cut, len(ids))]
        )
        np.testing.assert_array_equal(joined, expected.T)
    # Generated tokens: their position plus the prompt's delta, on all three axes (as HF's
    # decode, cache_position + rope_deltas).
    later = images.rope_positions(len(ids), len(ids) + 3)
    want = np.arange(len(ids), len(ids) + 3) + delta
    np.testing.assert_array_equal(later, np.stack([want] * 3, axis=1))


def test_a_span_that_is_not_its_grid_is_refused() -> None:
    ids, images = _prompt()
    bad = SequenceImages(images.images, images.spans, bidirectional=False, grids=((3, 4),) * 3)
    with pytest.raises(ValueError, match="3x4"):
        bad.rope_positions(0, len(ids))


@pytest.mark.parametrize("section", [(2, 3, 3), (4, 2, 2)])
def test_rotation_matches_transformers(section: tuple[int, int, int]) -> None:
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    head_dim, theta = 16, 5_000.0
    hf = Qwen3VLTextConfig(
        hidden_size=32, num_attention_heads=2, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta,
                         "mrope_section": list(section), "mrope_interleaved": True},
    )  # fmt: skip
    rng = np.random.default_rng(0)
    # [seq, (t, h, w)]; float32 angles of positions in the hundreds round at ~3e-5
    positions = rng.integers(0, 300, size=(9, 3)).astype(np.int32)
    x = rng.standard_normal((9, 2, head_dim)).astype(np.float32)  # [seq, heads, head_dim]
    rotary = Qwen3VLTextRotaryEmbedding(hf)
    t = torch.from_numpy(x)[None].transpose(1, 2)  # [1, heads, seq, head_dim]
    cos, sin = rotary(t, torch.from_numpy(positions.T.astype(np.int64))[:, None])
    want, _ = apply_rotary_pos_emb(t, t, cos, sin)
    rope = RopeConfig(
        theta=theta, rotary_dim=head_dim, mrope_section=section, mrope_interleaved=True
    )
    got = apply_rope(jnp.asarray(x), jnp.asarray(positions), rope)
    np.testing.assert_allclose(np.asarray(got), want[0].transpose(0, 1).numpy(), atol=1e-4)
    # Three equal positions are the plain rotation.
    plain = apply_rope(jnp.asarray(x), jnp.asarray(positions[:, 0]), rope)
    same = apply_rope(jnp.asarray(x), jnp.asarray(np.repeat(positions[:, :1], 3, 1)), rope)
    np.testing.assert_allclose(np.asarray(same), np.asarray(plain), atol=1e-6)


def test_sections() -> None:
    """Runs of frequencies must fill the rotary features; interleaved, the counts only bound
    each axis (transformers applies Qwen3.5's default [11, 11, 10] to a rotary width of 4)."""
    with pytest.raises(ValueError, match="summing to rotary_dim"):
        RopeConfig(theta=1e4, rotary_dim=16, mrope_section=(2, 2, 2))
    with pytest.raises(ValueError, match="three counts"):
        RopeConfig(theta=1e4, rotary_dim=16, mrope_section=(4, 4), mrope_interleaved=True)
    runs = RopeConfig(theta=1e4, rotary_dim=16, mrope_section=(2, 3, 3))
    assert runs.mrope_axes().tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    wide = RopeConfig(theta=1e4, rotary_dim=4, mrope_section=(11, 11, 10), mrope_interleaved=True)
    assert wide.mrope_axes().tolist() == [0, 1]
