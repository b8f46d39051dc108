"""Rotary embeddings (yarn, longrope, explicit frequency factors, interleaved pairs) against HF."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.models.layers.rotary import RopeConfig, apply_rope, rope_from_hf

HEAD_DIM = 32
# 16 frequencies; with theta 1e4 and an original context of 4096 yarn's ramp covers dims ~5..12,
# so the table has interpolated, blended and extrapolated parts.
SHAPE = dict(hidden_size=64, num_attention_heads=2, head_dim=HEAD_DIM)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 4096,
}
LONGROPE_ORIGINAL = 64
PHI3_ROTARY_DIM = 24  # Phi-4-mini style partial rotary: 0.75 of a 32-wide head


def _factors(n: int, low: float, high: float) -> list[float]:
    return [float(v) for v in np.linspace(low, high, n)]


LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": _factors(PHI3_ROTARY_DIM // 2, 1.0, 1.5),
    "long_factor": _factors(PHI3_ROTARY_DIM // 2, 1.0, 12.0),
}


def _llama_yarn(**overrides):
    from transformers import LlamaConfig

    params = {**YARN, **overrides}
    return LlamaConfig(**SHAPE, max_position_embeddings=16384, rope_parameters=params)


def _deepseek_yarn(**overrides):
    from transformers import DeepseekV3Config

    params = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8, **overrides}
    return DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=2,
        qk_rope_head_dim=HEAD_DIM,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=16384,
        rope_parameters=params,
    )


def _phi3_longrope(max_position_embeddings: int = 1024, **overrides):
    from transformers import Phi3Config

    return Phi3Config(
        **SHAPE,
        max_position_embeddings=max_position_embeddings,
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        partial_rotary_factor=PHI3_ROTARY_DIM / HEAD_DIM,
        rope_parameters={**LONGROPE, **overrides},
    )


YARN_CASES = {
    "yarn": lambda: _llama_yarn(),
    "yarn_no_truncate": lambda: _llama_yarn(truncate=False, beta_fast=16, beta_slow=2),
    "yarn_explicit_attention_factor": lambda: _llama_yarn(attention_factor=1.25),
    "yarn_factor_from_max_positions": lambda: _llama_yarn(factor=None),
    "yarn_deepseek_mscale": lambda: _deepseek_yarn(),
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_inv_freq_and_attention_factor_match_hf(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = YARN_CASES[case]()
    rope = rope_from_hf(hf.to_dict(), HEAD_DIM)
    ref, ref_attention = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    np.testing.assert_allclose(rope.inv_freq(), ref.numpy(), rtol=1e-6)
    assert rope.attention_scale == pytest.approx(ref_attention, rel=1e-12)


@pytest.mark.parametrize("long_context", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("max_positions", [1024, 48], ids=["extended", "not_extended"])
def test_longrope_inv_freq_and_attention_factor_match_hf(long_context, max_positions):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _phi3_longrope(max_positions)
    rope = rope_from_hf(hf.to_dict(), PHI3_ROTARY_DIM)
    seq_len = LONGROPE_ORIGINAL + 1 if long_context else None
    ref, ref_attention = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
    np.testing.assert_allclose(rope.inv_freq(long_context), ref.numpy(), rtol=1e-6)
    assert rope.attention_scale == pytest.approx(ref_attention, rel=1e-12)


def test_legacy_su_name_reads_as_longrope():
    """Phi-3 era config.json: kind "su" under ``rope_scaling`` and the original context length at
    the top level."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    legacy = {
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "original_max_position_embeddings": LONGROPE_ORIGINAL,
        "rope_scaling": {
            "type": "su",
            "short_factor": LONGROPE["short_factor"],
            "long_factor": LONGROPE["long_factor"],
        },
    }
    rope = rope_from_hf(legacy, PHI3_ROTARY_DIM)
    assert rope == rope_from_hf(_phi3_longrope().to_dict(), PHI3_ROTARY_DIM)
    ref, ref_attention = ROPE_INIT_FUNCTIONS["longrope"](_phi3_longrope(), "cpu")
    np.testing.assert_allclose(rope.inv_freq(), ref.numpy(), rtol=1e-6)
    assert rope.attention_scale == pytest.approx(ref_attention)


def _hf_rotate(rotary_module, apply_fn, q: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """HF's rotation of ``q`` [batch, seq, heads, head_dim] at ``positions`` [batch, seq]."""
    import torch

    q_hf = torch.from_numpy(q).transpose(1, 2)  # HF puts heads before seq
    pos = torch.from_numpy(positions).long()
    cos, sin = rotary_module(q_hf, pos)
    out, _ = apply_fn(q_hf, q_hf, cos, sin)
    return out.transpose(1, 2).numpy()


def _ours(q: np.ndarray, positions: np.ndarray, rope: RopeConfig) -> np.ndarray:
    rotate = jax.jit(apply_rope, static_argnums=2)
    return np.asarray(rotate(jnp.asarray(q), jnp.asarray(positions, jnp.int32), rope))


def _queries(seq: int, head_dim: int = HEAD_DIM, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, seq, 3, head_dim)).astype(np.float32)


@pytest.mark.parametrize("case", ["yarn", "yarn_deepseek_mscale"])
def test_yarn_apply_rope_matches_hf(case):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf = YARN_CASES[case]()
    rope = rope_from_hf(hf.to_dict(), HEAD_DIM)
    # Positions past the original context too: yarn's table does not depend on position.
    positions = np.stack([np.arange(0, 40), np.arange(9000, 9040)])
    q = _queries(40)
    ref = _hf_rotate(LlamaRotaryEmbedding(hf), apply_rotary_pos_emb, q, positions)
    ours = _ours(q, positions, rope)
    np.testing.assert_allclose(ours[0], ref[0], atol=2e-5)
    # Tables agree to an ulp (HF rounds in float32 at every step), and an ulp of frequency is
    # ~1e-3 rad of angle at position 9000: the far batch row gets a float32-angle tolerance.
    np.testing.assert_allclose(ours[1], ref[1], atol=2e-3)


def test_longrope_apply_rope_matches_hf_below_and_past_original_context():
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    hf = _phi3_longrope()
    rope = rope_from_hf(hf.to_dict(), PHI3_ROTARY_DIM)
    seq = 2 * LONGROPE_ORIGINAL
    positions = np.stack([np.arange(seq), np.arange(seq)])
    q = _queries(seq)
    ours = _ours(q, positions, rope)
    # HF picks one table per call: short while the sequence fits the original context ...
    short = LONGROPE_ORIGINAL
    ref_short = _hf_rotate(
        Phi3RotaryEmbedding(hf), apply_rotary_pos_emb, q[:, :short], positions[:, :short]
    )
    np.testing.assert_allclose(ours[:, :short], ref_short, atol=2e-5)
    # ... and long for all of it once it does not, which is where positions past it agree.
    ref_long = _hf_rotate(Phi3RotaryEmbedding(hf), apply_rotary_pos_emb, q, positions)
    np.testing.assert_allclose(ours[:, short:], ref_long[:, short:], atol=2e-5)
    assert not np.allclose(ours[:, :short], ref_long[:, :short], atol=1e-3)


def test_interleaved_partial_rotary_matches_glm4():
    from transformers import Glm4Config
    from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding, apply_rotary_pos_emb

    hf = Glm4Config(**SHAPE, rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 0.5})
    rotary_dim = int(HEAD_DIM * hf.rope_parameters["partial_rotary_factor"])
    rope = dataclasses.replace(rope_from_hf(hf.to_dict(), rotary_dim), interleaved=True)
    positions = np.stack([np.arange(30), np.arange(100, 130)])
    q = _queries(30)
    ref = _hf_rotate(Glm4RotaryEmbedding(hf), apply_rotary_pos_emb, q, positions)
    ours = _ours(q, positions, rope)
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    np.testing.assert_array_equal(ours[..., rotary_dim:], q[..., rotary_dim:])


def test_freq_factors_divide_the_frequencies():
    theta, rotary_dim = 10000.0, 16
    factors = np.linspace(1.0, 8.0, rotary_dim // 2)
    rope = RopeConfig(theta, rotary_dim, freq_factors=factors)
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2) / rotary_dim) / factors
    np.testing.assert_allclose(rope.inv_freq(), inv_freq, rtol=1e-6)

    positions = np.stack([np.arange(20), np.arange(500, 520)])
    q = _queries(20, head_dim=24)
    angles = positions[..., None, None] * inv_freq  # [batch, seq, 1, rotary_dim // 2]
    x1, x2 = q[..., : rotary_dim // 2], q[..., rotary_dim // 2 : rotary_dim]
    cos, sin = np.cos(angles), np.sin(angles)
    ref = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, q[..., rotary_dim:]], -1)
    np.testing.assert_allclose(_ours(q, positions, rope), ref, atol=2e-5)


def test_freq_factors_reproduce_llama3_scaling():
    """GGUF Llama 3 files carry llama3's divisors precomputed; they must give the same table."""
    llama3 = RopeConfig(
        500000.0, 64, rope_type="llama3", factor=8.0, original_max_position_embeddings=64
    )
    base = RopeConfig(500000.0, 64).inv_freq().astype(np.float64)
    factors = base / llama3.inv_freq().astype(np.float64)
    np.testing.assert_allclose(
        RopeConfig(500000.0, 64, freq_factors=factors).inv_freq(), llama3.inv_freq(), rtol=1e-6
    )


def test_factor_lists_become_hashable_tuples():
    rope = RopeConfig(10000.0, 4, freq_factors=np.array([1.0, 2.0], np.float32))
    assert rope.freq_factors == (1.0, 2.0)
    assert hash(rope) == hash(RopeConfig(10000.0, 4, freq_factors=(1.0, 2.0)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rope_type="dynamic"), r"'dynamic' is not supported \(default, linear, llama3, yarn"),
        (dict(freq_factors=(1.0, 2.0)), r"freq_factors needs one entry per rotary frequency"),
        (
            dict(rope_type="longrope", original_max_position_embeddings=64, short_factor=[1.0] * 3),
            r"short_factor needs one entry per rotary frequency \(rotary_dim // 2 = 4\), got 3",
        ),
        (
            dict(rope_type="longrope", original_max_position_embeddings=64, short_factor=[1.0] * 4),
            r"longrope rope scaling needs long_factor",
        ),
        (dict(freq_factors=(1.0, 1.0, 0.0, 1.0)), r"freq_factors entries must all be > 0"),
        (
            dict(rope_type="linear", factor=4.0, freq_factors=(1.0,) * 4),
            r"freq_factors applies to rope_type 'default', not 'linear'",
        ),
        (dict(rope_type="yarn", factor=4.0), r"yarn rope scaling needs original_max_position"),
        (
            dict(rope_type="yarn", original_max_position_embeddings=64, beta_fast=1, beta_slow=2),
            r"0 < beta_slow < beta_fast",
        ),
        (dict(attention_factor=2.0), r"attention_factor applies to yarn and longrope"),
    ],
)
def test_invalid_rope_configs_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RopeConfig(10000.0, 8, **kwargs)


def test_hf_dynamic_ntk_is_rejected():
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        rope_from_hf({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 16)


def test_yarn_without_any_context_lengths_is_a_clear_error():
    with pytest.raises(ValueError, match="yarn rope scaling needs original_max_position"):
        rope_from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 16)
