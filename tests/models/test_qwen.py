"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, explicit head_dim) against HF."""

from __future__ import annotations

import pytest

from models.registry import get_model_spec
from tests.models.harness import TINY, check_against_hf


def test_qwen2_matches_hf(tmp_path):
    from transformers import Qwen2Config

    model = check_against_hf(Qwen2Config(**TINY, tie_word_embeddings=True), tmp_path)
    assert "bq" in model.weights["layers"]


def test_qwen3_matches_hf(tmp_path):
    from transformers import Qwen3Config

    # head_dim deliberately differs from hidden_size // num_attention_heads.
    model = check_against_hf(Qwen3Config(**TINY, head_dim=32), tmp_path)
    assert model.config.head_dim == 32
    assert model.weights["layers"]["q_norm"].shape == (2, 32)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_sliding_window_is_refused(arch):
    hf = {**TINY, "architectures": [arch], "use_sliding_window": True, "sliding_window": 16}
    with pytest.raises(ValueError, match="use_sliding_window"):
        get_model_spec(arch).config_from_hf(hf)
