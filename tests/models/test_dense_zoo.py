"""Dense architectures against HF transformers on tiny random models (see harness.py):
Mistral/Ministral (sliding windows), Phi-2, Phi-3 (fused projections, longrope), Gemma 1/2/3
(offset norms, soft-caps, alternating sliding layers, dual rope), StableLM and GLM-4.

Prompts (up to 22 tokens) plus 16 decoded tokens run well past the 8-token windows used here.
"""

from __future__ import annotations

import pytest

from tests.models.harness import TINY, check_against_hf

WINDOW = 8


def _config(name: str, **fields):
    import transformers

    # Some configs default pad_token_id past the tiny vocabulary.
    return getattr(transformers, name)(**{**TINY, "pad_token_id": 0, **fields})


def test_mistral_sliding_window(tmp_path):
    model = check_against_hf(_config("MistralConfig", sliding_window=WINDOW), tmp_path)
    assert model.config.sliding_layers == (True, True)


def test_mistral_without_window(tmp_path):
    model = check_against_hf(_config("MistralConfig", sliding_window=None), tmp_path)
    assert model.config.attention.sliding_window is None


def test_ministral_layer_types(tmp_path):
    hf = _config(
        "MinistralConfig",
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    assert check_against_hf(hf, tmp_path).config.sliding_layers == (True, False)


def test_ministral3_yarn_and_query_scale(tmp_path):
    rope = {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": 1.0,
        "mscale": 1.0,
        # Positions past 16 get a larger query temperature, so decoding exercises it.
        "llama_4_scaling_beta": 0.1,
    }
    hf = _config("Ministral3Config", head_dim=16, rope_parameters=rope)
    model = check_against_hf(hf, tmp_path)
    assert model.config.attention.position_query_scale == (0.1, 16)


def test_phi2(tmp_path):
    hf = _config("PhiConfig", partial_rotary_factor=0.5, hidden_act="gelu_new")
    model = check_against_hf(hf, tmp_path)
    assert model.config.attention.rope.rotary_dim == 8
    assert model.config.parallel_residual


def test_phi2_qk_layernorm(tmp_path):
    check_against_hf(_config("PhiConfig", qk_layernorm=True), tmp_path)


def test_phi3_longrope(tmp_path):
    half = 16 * 3 // 4 // 2  # head_dim 16, partial rotary 0.75
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.3 * i for i in range(half)],
    }
    hf = _config("Phi3Config", original_max_position_embeddings=64, rope_parameters=rope)
    model = check_against_hf(hf, tmp_path)
    assert model.config.attention.rope.rope_type == "longrope"


def test_phi3_sliding_window(tmp_path):
    check_against_hf(_config("Phi3Config", sliding_window=WINDOW), tmp_path)


def test_gemma(tmp_path):
    check_against_hf(_config("GemmaConfig", head_dim=16), tmp_path)


def test_gemma2_soft_caps_and_alternating_windows(tmp_path):
    hf = _config(
        "Gemma2Config",
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        # Small caps so that capping changes the result.
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    )
    model = check_against_hf(hf, tmp_path)
    assert model.config.sliding_layers == (True, False)
    assert model.config.final_soft_cap == 3.0


def test_gemma3_dual_rope_and_qk_norm(tmp_path):
    hf = _config(
        "Gemma3TextConfig",
        num_hidden_layers=3,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        sliding_window_pattern=3,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
        },
    )
    hf.architectures = ["Gemma3ForCausalLM"]
    model = check_against_hf(hf, tmp_path)
    assert model.config.sliding_layers == (True, True, False)
    assert model.config.attention.local_rope.theta == 10_000.0


@pytest.mark.parametrize("parallel", [False, True])
def test_stablelm(tmp_path, parallel):
    hf = _config(
        "StableLmConfig",
        partial_rotary_factor=0.25,
        use_qkv_bias=True,
        qk_layernorm=True,
        use_parallel_residual=parallel,
    )
    check_against_hf(hf, tmp_path)


def test_glm4(tmp_path):
    model = check_against_hf(_config("Glm4Config", attention_bias=True), tmp_path)
    assert model.config.attention.rope.interleaved
