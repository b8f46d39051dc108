"""``tools/quantize_gguf.py``'s library half: a GGUF re-quantized the way ``--isq`` quantizes.

The output keeps every metadata key and non-projection tensor, holds llama.cpp's quantizer bytes
for each projection (with llama.cpp's fallback for narrow widths), and loads back packed.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from transformers import LlamaConfig

from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight
from jax_llm_runtime.pallas_kernels.dequant_matmul.quantize import quantize_rows
from jax_llm_runtime.runtime.loading.gguf.loader import load_gguf_checkpoint
from jax_llm_runtime.runtime.loading.gguf.quantize import requantize_gguf
from tests.models.gguf_writer import write_gguf
from tests.models.harness import load_checkpoint
from tests.runtime.test_gguf_archs import _random_model

T = gguf.GGMLQuantizationType


def _source(tmp_path: Path) -> Path:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,  # not a multiple of 256: q4k falls back to Q5_0 here
        intermediate_size=256,  # ... but the down projection (256 wide) takes Q4_K
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = _random_model(config)
    return write_gguf(model, model.config, tmp_path / "f16.gguf", qtype="f16")[0]


def test_requantized_file(tmp_path: Path) -> None:
    source = _source(tmp_path)
    target = tmp_path / "q4k.gguf"
    report = {t.name: t for t in requantize_gguf(source, target, "q4k")}
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(target)
    for name, field in before.fields.items():
        if not name.startswith("GGUF.") and name != gguf.Keys.General.FILE_TYPE:
            assert after.fields[name].contents() == field.contents(), name
    assert after.fields[gguf.Keys.General.FILE_TYPE].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_S
    originals = {t.name: t for t in before.tensors}
    for tensor in after.tensors:
        original = originals[tensor.name]
        if tensor.name.endswith("ffn_down.weight"):
            assert tensor.tensor_type == T.Q4_K
        elif not tensor.name.startswith("blk.") or "norm" in tensor.name:
            assert tensor.tensor_type == original.tensor_type
            assert not report[tensor.name].requantized
            np.testing.assert_array_equal(tensor.data, original.data)
            continue
        else:
            assert tensor.tensor_type == T.Q5_0, tensor.name
        values = dequantize(np.asarray(original.data), original.tensor_type)
        expected = quantize_rows(values.reshape(-1, values.shape[-1]), tensor.tensor_type)
        np.testing.assert_array_equal(np.asarray(tensor.data).reshape(expected.shape), expected)
    model = load_checkpoint(load_gguf_checkpoint(target))
    assert isinstance(model.weights["segments"][0]["w_down"], PackedWeight)


def test_refuses_bad_requests(tmp_path: Path) -> None:
    source = _source(tmp_path)
    with pytest.raises(ValueError, match="type must be one of"):
        requantize_gguf(source, tmp_path / "x.gguf", "q4_k_m")
    with pytest.raises(ValueError, match="exists"):
        requantize_gguf(source, source, "q4_0")
