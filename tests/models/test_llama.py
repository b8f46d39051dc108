"""Llama with Llama 3 (and linear) rope scaling against HF transformers."""

from __future__ import annotations

import numpy as np
import pytest

from jax_llm_runtime.models.layers.rotary import RopeConfig, rope_from_hf
from tests.models.harness import TINY, check_against_hf

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny head's wavelengths fall in all three bands.
    "original_max_position_embeddings": 64,
}


def test_llama3_scaled_llama_matches_hf(tmp_path):
    from transformers import LlamaConfig

    model = check_against_hf(LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE), tmp_path)
    assert model.config.attention.rope.rope_type == "llama3"


@pytest.mark.parametrize(
    "params",
    [
        LLAMA3_ROPE,
        {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
        {"rope_type": "default", "rope_theta": 10000.0},
    ],
    ids=["llama3", "linear", "default"],
)
def test_inv_freq_matches_hf_rope_init(params):
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(**TINY, rope_parameters=dict(params))
    head_dim = hf.hidden_size // hf.num_attention_heads
    ours = rope_from_hf(hf.to_dict(), head_dim).inv_freq()
    if params["rope_type"] == "default":
        ref = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


def test_legacy_rope_scaling_dict_is_read():
    hf = {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert rope_from_hf(hf, 16) == RopeConfig(500000.0, 16, rope_type="linear", factor=2.0)


def test_unsupported_rope_scaling_is_a_clear_error():
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        rope_from_hf({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, 16)
