"""Gemma 4 and Llama 4 (text) against HF transformers on tiny random models (see harness.py).

Gemma 4: plain RMSNorm weights, v norm, attention scale 1, a scalar per layer, and full layers
with wider heads, fewer KV heads whose values are their keys, on a proportional rope; the
norms and layer scalars are randomised so that a mix-up shows.
"""

from __future__ import annotations

import pytest

from tests.models.harness import TINY, check_model, load_ours

WINDOW = 8


def _gemma4_config(**fields):
    import transformers

    base = dict(
        TINY,
        num_hidden_layers=3,
        head_dim=16,
        global_head_dim=32,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_size_per_layer_input=0,
        pad_token_id=0,
        final_logit_softcapping=3.0,
    )
    config = transformers.Gemma4TextConfig(**{**base, **fields})
    config.architectures = ["Gemma4ForCausalLM"]
    return config


def _randomised(hf_config, folder, seed: int = 0):
    """A seeded random HF model whose norm weights and layer scalars are random too (HF
    initialises them to ones), saved as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "layer_scalar")):
                tensor.copy_(0.5 + torch.rand_like(tensor))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _check(hf_config, folder):
    hf_model = _randomised(hf_config, folder)
    model = load_ours(folder)
    check_model(model, hf_model)
    return model


def test_gemma4_wide_full_layers_with_values_from_keys(tmp_path):
    hf = _gemma4_config(attention_k_eq_v=True, num_global_key_value_heads=1)
    model = _check(hf, tmp_path)
    att = model.config.attention
    assert (att.head_dim, att.head_dims, att.num_kv_heads) == (32, (16, 32), 2)
    assert model.config.sliding_layers == (True, False, False)  # the last layer is full
