"""Tiny random llama GGUF files written with ``gguf.GGUFWriter``, laid out as llama.cpp writes them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 40,
    "max_position_embeddings": 128,
}
# GGUF name -> HF name (after "model.layers.N." for the per-layer ones).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` q/k row permutation (HF halves -> interleaved)."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _hf_shapes(tied: bool) -> dict[str, tuple[int, ...]]:
    c = TINY_LLAMA
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    layer = {
        "input_layernorm": (hidden,),
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "post_attention_layernorm": (hidden,),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    shapes = {
        "model.embed_tokens.weight": (c["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for n in range(c["num_hidden_layers"]):
        shapes.update({f"model.layers.{n}.{k}.weight": v for k, v in layer.items()})
    if not tied:
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    return shapes


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, n, rest = hf_name.split(".", 3)
        inverse = {v: k for k, v in LAYER_NAMES.items()}
        return f"blk.{n}.{inverse[rest.removesuffix('.weight')]}.weight"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def write_tiny_llama_gguf(
    path: Path,
    *,
    tied: bool = False,
    seed: int = 0,
    arch: str = "llama",
    skip_keys: tuple[str, ...] = (),
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a random tiny llama GGUF and return the HF-layout float32 tensors it should load as.

    Norms are F32, attention weights F16, MLP and embeddings Q8_0 (so the expected arrays are the
    dequantized ones); q/k rows are permuted as llama.cpp does.
    """
    c = TINY_LLAMA
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    meta = {
        "block_count": c["num_hidden_layers"],
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"],
        "vocab_size": c["vocab_size"],
    }
    for key, value in meta.items():
        if key not in skip_keys:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 50000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    expected: dict[str, np.ndarray] = {}
    for hf_name, shape in _hf_shapes(tied).items():
        weight = rng.standard_normal(shape, dtype=np.float32)
        name = _gguf_name(hf_name)
        stored = weight
        if ".attn_q." in name:
            stored = llama_cpp_permute(weight, c["num_attention_heads"])
        elif ".attn_k." in name:
            stored = llama_cpp_permute(weight, c["num_key_value_heads"])
        if len(shape) == 1:
            writer.add_tensor(name, stored)
            expected[hf_name] = weight
        elif name.startswith("blk.") and ".attn_" in name:
            writer.add_tensor(name, stored.astype(np.float16))
            expected[hf_name] = weight.astype(np.float16).astype(np.float32)
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(stored, q8), raw_dtype=q8)
            # Q8_0 blocks run along rows, so row permutation commutes with quantization.
            expected[hf_name] = dequantize(quantize(weight, q8), q8)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
