"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, explicit head_dim) against HF."""

from __future__ import annotations

import pytest

from tests.models.harness import TINY, check_against_hf


def test_qwen2_matches_hf(tmp_path):
    from transformers import Qwen2Config

    model = check_against_hf(Qwen2Config(**TINY, tie_word_embeddings=True), tmp_path)
    assert "bq" in model.weights["segments"][0]


def test_qwen3_matches_hf(tmp_path):
    from transformers import Qwen3Config

    # head_dim deliberately differs from hidden_size // num_attention_heads.
    model = check_against_hf(Qwen3Config(**TINY, head_dim=32), tmp_path)
    assert model.config.head_dim == 32
    assert model.weights["segments"][0]["q_norm"].shape == (2, 32)


@pytest.mark.parametrize("config_class", ["Qwen2Config", "Qwen3Config"])
def test_sliding_window_layers_match_hf(tmp_path, config_class):
    import transformers

    # Layers from max_window_layers on slide over 8 tokens; prompts and decode run past that.
    hf_config = getattr(transformers, config_class)(
        **TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    model = check_against_hf(hf_config, tmp_path)
    assert model.config.sliding_layers == (False, True)
    assert model.config.attention.sliding_window == 8
