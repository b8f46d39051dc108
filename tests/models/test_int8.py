"""Weight-only int8 (``--isq int8``): the quantized model computes exactly what HF computes on
the same quantize-dequantized weights, so the only error is the quantization itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from jax_llm_runtime.models.layers.linear import QuantizedWeight, quantize_int8
from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
from tests.models.harness import TINY, Loaded, check_model, save_random_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _round_trip(weight_out_in):
    """HF ``[out, in]`` weight -> our int8 -> back, as float32 ``[out, in]``."""
    import torch

    q = quantize_int8(weight_out_in.detach().numpy().T)
    dequant = np.asarray(q.q, np.float32) * np.asarray(q.scale)[None, :]
    return torch.from_numpy(dequant.T.copy())


@pytest.mark.parametrize("tied", [True, False])
def test_int8_model_matches_hf_on_dequantized_weights(tmp_path: Path, tied: bool) -> None:
    import torch
    from transformers import LlamaConfig

    from jax_llm_runtime.models.registry import get_model_spec

    hf_model = save_random_model(LlamaConfig(**TINY, tie_word_embeddings=tied), tmp_path)
    checkpoint = load_hf_checkpoint(tmp_path)
    spec = get_model_spec("LlamaForCausalLM")
    config = dataclasses.replace(spec.config_from_hf(checkpoint.config), quantization="int8")
    weights = spec.load(config, checkpoint.tensors(), np.float32, checkpoint.num_tensors)
    layer = weights["segments"][0]
    assert isinstance(layer["w_up"], QuantizedWeight) and layer["w_up"].q.dtype == np.int8
    assert not isinstance(weights.get("lm_head"), QuantizedWeight)  # the LM head stays float

    with torch.no_grad():
        for name, module in hf_model.named_modules():
            if name.rsplit(".", 1)[-1] in PROJECTIONS:
                module.weight.copy_(_round_trip(module.weight))
    check_model(Loaded(spec, config, weights), hf_model)


def test_quantize_int8_error_is_bounded() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 64, 32)).astype(np.float32)
    q = quantize_int8(w)
    assert q.q.shape == (3, 64, 32) and q.scale.shape == (3, 32)
    dequant = np.asarray(q.q, np.float32) * np.asarray(q.scale)[:, None, :]
    # Round to nearest: at most half a step, a step being max|w| / 127 per output channel.
    step = np.abs(w).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(dequant - w) <= step / 2 + 1e-7)


def test_int8_operands_round_the_activations_of_int8_weights() -> None:
    """--matmul-dtype int8 with --isq int8: the activations are rounded as for packed weights
    (blocks of 32, one scale each) and multiply the int8 weight in float32; a lone row (one
    sequence decoding alone) is rounded the same, so its output does not depend on its batch."""
    import jax.numpy as jnp

    from jax_llm_runtime.models.layers.linear import linear
    from jax_llm_runtime.pallas_kernels.dequant_matmul.reference import quantize_activations

    rng = np.random.default_rng(1)
    q = quantize_int8(rng.standard_normal((64, 48)).astype(np.float32), "int8")
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    dequant = np.asarray(q.q, np.float64) * np.asarray(q.scale, np.float64)[None, :]
    rounded = np.asarray(quantize_activations(x), np.float64)
    assert not np.allclose(rounded, np.asarray(x))
    np.testing.assert_allclose(np.asarray(linear(x, q)), rounded @ dequant, atol=1e-4)
    np.testing.assert_allclose(np.asarray(linear(x[:1], q)), rounded[:1] @ dequant, atol=1e-4)
