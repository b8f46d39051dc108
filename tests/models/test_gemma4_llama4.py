"""Gemma 4 and Llama 4 (text) against HF transformers on tiny random models (see harness.py).

Gemma 4: plain RMSNorm weights, v norm, attention scale 1, a scalar per layer, and full layers
with wider heads, fewer KV heads whose values are their keys, on a proportional rope; the
norms and layer scalars are randomised so that a mix-up shows.
"""

from __future__ import annotations

import pytest

from tests.models.harness import (
    TINY,
    check_last_logits,
    greedy_hf,
    greedy_paged,
    load_ours,
    prompts,
)

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
    # The harness's ``check_model``, reading the vocabulary of a multimodal config's text model.
    ids = prompts(hf_model.config.get_text_config().vocab_size)
    check_last_logits(model, hf_model, ids)
    assert greedy_paged(model, ids) == [greedy_hf(hf_model, p) for p in ids]
    return model


def test_gemma4_wide_full_layers_with_values_from_keys(tmp_path):
    hf = _gemma4_config(attention_k_eq_v=True, num_global_key_value_heads=1)
    model = _check(hf, tmp_path)
    att = model.config.attention
    assert (att.head_dim, att.head_dims, att.num_kv_heads) == (32, (16, 32), 2)
    assert model.config.sliding_layers == (True, False, False)  # the last layer is full


def test_gemma4_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration: the text model under ``model.language_model``, the
    vision tower skipped; full layers with their own v projection, widened like the rest."""
    import transformers

    text = _gemma4_config(rope_parameters=_ROPES).to_dict()
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    hf = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    hf.architectures = ["Gemma4ForConditionalGeneration"]
    model = _check(hf, tmp_path)
    assert model.config.attention.rope.factor == 2.0
    assert not model.config.attention.full_values_from_keys


_ROPES = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0, "factor": 2.0,
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size_per_layer_input", 256),
        ("num_kv_shared_layers", 1),
        ("enable_moe_block", True),
    ],
)
def test_gemma4_unsupported_parts_are_refused(field, value):
    from jax_llm_runtime.models.registry import model_config_from_hf

    hf = {**_gemma4_config().to_dict(), field: value}
    with pytest.raises(ValueError, match=f"^Gemma 4 .*{field}={value!r}"):
        model_config_from_hf(hf)


@pytest.mark.slow
def test_gemma4_tensor_parallel_over_2_and_4_devices(tmp_path):
    """Greedy tokens do not change with the tensor-parallel size; the full layers' 2 KV heads
    are repeated to the sliding layers' 4, so every layer splits over 4 devices."""
    from tests.models.tiny_tokenizer import save_byte_tokenizer
    from tests.runtime.test_tensor_parallel import BASE, check_split, run_sharded

    hf = _gemma4_config(
        **{k: BASE[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")},
        num_attention_heads=8,
        num_key_value_heads=4,
        attention_k_eq_v=True,
        num_global_key_value_heads=2,
    )
    _randomised(hf, tmp_path)
    save_byte_tokenizer(tmp_path)
    check_split(run_sharded(tmp_path, "1,2,4"))


# Llama 4: 4 layers, every 4th without rope (so layer 3 attends to everything with the query
# temperature), the others in chunks of 8 positions; prompts of up to 22 tokens plus 16 decoded
# cross several chunks. A floor scale of 4 makes the temperature change within the prompts.
LLAMA4 = dict(
    TINY,
    num_hidden_layers=4,
    head_dim=16,
    intermediate_size=32,
    intermediate_size_mlp=96,
    num_local_experts=4,
    num_experts_per_tok=1,
    attention_chunk_size=8,
    floor_scale=4,
    attn_scale=0.5,
    pad_token_id=0,
)


def _llama4_config(**fields):
    import transformers

    config = transformers.Llama4TextConfig(**{**LLAMA4, **fields})
    config.architectures = ["Llama4ForCausalLM"]
    return config


def test_llama4_chunked_nope_layers_and_moe(tmp_path):
    model = _check(_llama4_config(), tmp_path)
    cfg = model.config
    assert cfg.chunked_layers == (True, True, True, False)
    assert cfg.nope_layers == (False, False, False, True)
    assert cfg.segments == ((0, 4, True),)
    assert cfg.attention.rope.interleaved
