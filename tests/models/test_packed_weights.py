"""Quantized weights stay packed from the file to the matmul, and compute what the file says.

- A GGUF file whose projections cycle through all ten block types (so every field stacks layers
  of different types, as ``Q4_K_M`` files do) loads packed, and our model on it matches HF on
  the dequantized tensors: logits and greedy tokens through the paged cache.
- ``--isq``: every type packs float weights into exactly the values ``gguf`` dequantizes from
  the block bytes our quantizer writes (llama.cpp's bytes: ``tests/pallas_kernels``); k-quant
  widths that are not multiples of 256 fall back as llama.cpp's quantizer does.
- Device bytes per weight of each packed format.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from transformers import LlamaConfig

from jax_llm_runtime.models.decoder import QUANTIZATIONS
from jax_llm_runtime.models.isq import ISQ_TYPES, block_type, packer
from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight
from jax_llm_runtime.pallas_kernels.dequant_matmul.host import dequantize_host
from jax_llm_runtime.pallas_kernels.dequant_matmul.quantize import QUANT_TYPES, quantize_rows
from jax_llm_runtime.runtime.loading.gguf.loader import load_gguf_checkpoint
from tests.models.gguf_writer import write_gguf
from tests.models.harness import PagedRunner, check_model, load_checkpoint
from tests.runtime.test_gguf_archs import _random_model

T = GGMLQuantizationType


def _config(**overrides) -> LlamaConfig:
    # Widths that are multiples of 256, so that every k-quant applies.
    options = dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaConfig(**(options | overrides))


def test_mixed_type_gguf_runs_like_its_dequantized_weights(tmp_path: Path) -> None:
    import torch

    hf_model = _random_model(_config())
    types = itertools.cycle(ISQ_TYPES)
    chosen: dict[str, str] = {}

    def qtype(name: str) -> str:
        return chosen.setdefault(name, next(types))

    files = write_gguf(hf_model, hf_model.config, tmp_path / "mixed.gguf", qtype=qtype)
    checkpoint = load_gguf_checkpoint(files[0])
    # 3 layers x 7 projections cycle through all ten types, so every field mixes types.
    assert set(chosen.values()) == set(ISQ_TYPES)
    model = load_checkpoint(checkpoint)
    layers = model.weights["segments"][0]
    for field in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert isinstance(layers[field], PackedWeight), field
    state = {name: torch.from_numpy(array) for name, array in checkpoint.tensors()}
    hf_model.load_state_dict(state, strict=False)
    check_model(model, hf_model)


@pytest.mark.parametrize("name", ISQ_TYPES)
def test_isq_packs_what_gguf_dequantizes(name: str) -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((512, 96)).astype(np.float32) * 0.02  # [in, out]
    packed = packer(name)(weight)
    qtype = QUANT_TYPES[name]
    expected = dequantize(quantize_rows(weight.T.copy(), qtype), qtype).T
    np.testing.assert_array_equal(dequantize_host(packed), expected)
    got = np.asarray(jax.jit(lambda w: w)(packed.to_device()).planes[0])
    assert got.dtype == np.uint8


def test_isq_falls_back_like_llama_cpp() -> None:
    assert block_type("q4k", 576) == T.Q5_0  # SmolLM2's hidden size is not a multiple of 256
    assert block_type("q6k", 576) == T.Q8_0
    assert block_type("q2k", 576) == T.Q4_0
    assert block_type("q4k", 1536) == T.Q4_K
    assert block_type("q4_0", 100) is None  # not even 32-blocks: stays float
    weight = np.ones((100, 8), np.float32)
    assert packer("q4_0")(weight) is weight
    assert set(ISQ_TYPES) <= set(QUANTIZATIONS)


def test_isq_model_runs_packed(tmp_path: Path) -> None:
    """``--isq q4k`` on a float checkpoint: packed projections that run like their values."""
    import dataclasses

    import torch

    hf_model = _random_model(_config(num_hidden_layers=2))
    files = write_gguf(hf_model, hf_model.config, tmp_path / "f32.gguf")
    checkpoint = load_gguf_checkpoint(files[0])
    loaded = load_checkpoint(checkpoint)
    config = dataclasses.replace(loaded.config, quantization="q4k")
    weights = loaded.spec.load(config, checkpoint.tensors(packed=True), np.float32)
    layers = weights["segments"][0]
    assert isinstance(layers["w_down"], PackedWeight)
    # HF on the same quantized values is the reference.
    state = {name: torch.from_numpy(array) for name, array in checkpoint.tensors()}
    for name, array in state.items():
        if name.endswith("proj.weight"):
            qtype = QUANT_TYPES["q4k"]
            rows = quantize_rows(array.numpy(), qtype)
            state[name] = torch.from_numpy(dequantize(rows, qtype))
    hf_model.load_state_dict(state, strict=False)
    check_model(dataclasses.replace(loaded, config=config, weights=weights), hf_model)


# Bits per weight on the device: codes plus scales (GGUF's own figure in the comment).
BITS_PER_WEIGHT = {
    "q4_0": 4.5,  # 4.5
    "q4_1": 5.0,  # 5.0
    "q5_0": 5.5,  # 5.5
    "q5_1": 6.0,  # 6.0
    "q8_0": 8.5,  # 8.5
    "q2k": 3.125,  # 2.625: the 4-bit sub-scales and mins take a byte each here
    "q3k": 3.5625,  # 3.4375
    "q4k": 4.625,  # 4.5: the 6-bit sub-scales and mins take a byte each here
    "q5k": 5.625,  # 5.5
    "q6k": 6.5625,  # 6.5625
}


@pytest.mark.parametrize("name", ISQ_TYPES)
def test_device_bits_per_weight(name: str) -> None:
    weight = np.random.default_rng(1).standard_normal((512, 64)).astype(np.float32)
    packed = packer(name)(weight).to_device()
    assert packed.nbytes * 8 / weight.size == BITS_PER_WEIGHT[name]


@pytest.mark.parametrize("case", ["mixtral", "qwen2moe"])
def test_moe_gguf_keeps_experts_packed(case: str, tmp_path: Path) -> None:
    """Expert stacks stay packed too (gathered per token for decode, dequantized per layer for
    the grouped prefill path), shared experts included, and compute what the same model does on
    the dequantized floats (transformers names fused expert tensors differently from the
    per-expert names a GGUF gives, so our float load is the reference here; the float MoE path
    itself is checked against HF in test_gguf_models)."""
    import dataclasses

    from tests.models.harness import greedy_paged, prompts
    from tests.runtime.test_gguf_archs import CASES

    hf_model = _random_model(CASES[case]())
    types = itertools.cycle(("q4_0", "q8_0", "q5_1"))
    chosen: dict[str, str] = {}
    files = write_gguf(
        hf_model,
        hf_model.config,
        tmp_path / "moe.gguf",
        qtype=lambda name: chosen.setdefault(name, next(types)),
    )
    checkpoint = load_gguf_checkpoint(files[0])
    packed = load_checkpoint(checkpoint)
    layers = packed.weights["segments"][-1]
    for field in ("e_gate", "e_up", "e_down"):
        assert isinstance(layers[field], PackedWeight), field
    if case == "qwen2moe":
        assert isinstance(layers["s_gate"], PackedWeight)
    floats = packed.spec.load(packed.config, checkpoint.tensors(), np.float32)
    reference = dataclasses.replace(packed, weights=floats)
    ids = prompts(hf_model.config.vocab_size)
    ours, ref = PagedRunner(packed, 32, len(ids)).step(ids), PagedRunner(reference, 32, len(ids))
    np.testing.assert_allclose(ours, ref.step(ids), rtol=0, atol=1e-5)
    assert greedy_paged(packed, ids) == greedy_paged(reference, ids)


@pytest.mark.parametrize("rows", [1, 5])
def test_bfloat16_operands_are_the_rounded_products_summed_in_float32(rows: int) -> None:
    from jax_llm_runtime.pallas_kernels.dequant_matmul import dequant_matmul

    rng = np.random.default_rng(3)
    weight = rng.standard_normal((256, 96)).astype(np.float32)
    packed = packer("q8_0")(weight).to_device("bfloat16")
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    x16 = jax.numpy.asarray(x).astype(jax.numpy.bfloat16)
    values = np.asarray(jax.numpy.asarray(dequantize_host(packer("q8_0")(weight))))
    rounded = np.asarray(jax.numpy.asarray(values).astype(jax.numpy.bfloat16), np.float64)
    expected = np.asarray(x16, np.float64) @ rounded
    out = np.asarray(dequant_matmul(x16, packed))
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-4)
    # One row alone gives what it gives among others (same rounded products).
    np.testing.assert_allclose(out[:1], np.asarray(dequant_matmul(x16[:1], packed)), atol=1e-4)


@pytest.mark.parametrize(
    ("operand", "native"),
    [("bfloat16", False), ("int8", False), ("int8", True)],
    ids=["bfloat16", "int8-xla", "int8-native"],
)
def test_rounded_operands_keep_the_model_close_to_hf(
    tmp_path: Path, operand: str, native: bool
) -> None:
    """--matmul-dtype bfloat16 / int8: logits within 2% of HF's float32 on the same quantized
    values, and different from the float32-operand run (the rounding is really applied); int8
    on the native kernel's integer dots (with the packed LM head) as on the XLA formulation."""
    import dataclasses

    import torch

    from jax_llm_runtime.pallas_kernels.dequant_matmul import native as native_dequant
    from tests.models.harness import prompts

    if native and not native_dequant.available():
        pytest.skip("no C++ compiler built the native kernel here (it runs wherever one does)")
    hf_model = _random_model(_config())
    files = write_gguf(hf_model, hf_model.config, tmp_path / "q8.gguf", qtype="q8_0")
    checkpoint = load_gguf_checkpoint(files[0])
    exact = load_checkpoint(checkpoint)
    config = dataclasses.replace(exact.config, operand_dtype=operand, native_kernels=native)
    weights = exact.spec.load(config, checkpoint.tensors(packed=True), np.float32)
    rounded = dataclasses.replace(exact, config=config, weights=weights)
    assert weights["segments"][0]["wq"].operand_dtype == operand
    ids = prompts(hf_model.config.vocab_size)
    ours = PagedRunner(rounded, 32, len(ids)).step(ids)
    floats = PagedRunner(exact, 32, len(ids)).step(ids)
    state = {name: torch.from_numpy(array) for name, array in checkpoint.tensors()}
    hf_model.load_state_dict(state, strict=False)
    for i, prompt in enumerate(ids):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0, -1].numpy()
        scale = np.abs(ref).max()
        np.testing.assert_allclose(ours[i], ref, atol=2e-2 * scale, rtol=0)
        np.testing.assert_allclose(floats[i], ref, atol=1e-4, rtol=0)
    assert not np.array_equal(ours, floats)
