"""GPTQ and AWQ test checkpoints packed here, in the published formats, from random weights.

``reference_gptq`` and ``reference_awq`` dequantize the checkpoint tensors independently of
``pallas_kernels.dequant_matmul.gptq``: torch bit operations written from the formats as AutoGPTQ
(``QuantLinear``'s torch path) and AutoAWQ (``unpack_awq``, ``reverse_awq_order``,
``dequantize_gemm``) publish them, with the products taken in float32 (the originals multiply in
the scales' float16, which rounds differently).

``write_quantized_llama`` quantizes a tiny random Llama's projections (round to nearest, min-max
per group) and saves them as a GPTQ or AWQ HF folder split over two shards, one linear's
tensors straddling them; its float model, holding the dequantized weights, is the reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.gptq import pack_awq, pack_gptq
from tests.models.harness import TINY, save_random_model

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # position p of 8 columns reads nibble [p]


@dataclass
class Ints:
    """One linear's quantization: ``w = scales[g] * (codes - zeros[g])``."""

    codes: np.ndarray  # uint8 [in, out]
    zeros: np.ndarray  # uint8 [groups, out]
    scales: np.ndarray  # float16 [groups, out]


@dataclass
class QuantizedModel:
    folder: Path
    hf_model: Any  # the float HF model with the dequantized weights
    linears: dict[str, Ints]  # "model.layers.0.self_attn.q_proj" -> its quantization


def random_ints(
    k: int, n: int, group_size: int, rng: np.random.Generator, zeros=(0, 15), bits: int = 4
) -> Ints:
    groups = 1 if group_size == -1 else k // group_size
    return Ints(
        codes=rng.integers(0, 1 << bits, (k, n)).astype(np.uint8),
        zeros=rng.integers(zeros[0], zeros[1] + 1, (groups, n)).astype(np.uint8),
        scales=rng.uniform(0.001, 0.1, (groups, n)).astype(np.float16),
    )


def dequantize(ints: Ints | HostPacked) -> np.ndarray:  # float32 [in, out]
    if isinstance(ints, HostPacked):
        ints = Ints(ints.codes, ints.z, ints.d)
    group = ints.codes.shape[0] // ints.scales.shape[0]
    z = np.repeat(ints.zeros.astype(np.int32), group, axis=0)
    d = np.repeat(ints.scales.astype(np.float32), group, axis=0)
    return d * (ints.codes.astype(np.int32) - z).astype(np.float32)


def reference_gptq(qweight, qzeros, scales, g_idx, checkpoint_format="gptq", bits=4) -> np.ndarray:
    """[in, out] float32 from GPTQ tensors: 32 / bits codes per int32, low first, down ``in``
    for the weight and across ``out`` for the zeros; v1 zeros are stored minus one."""
    import torch

    qweight, qzeros = torch.from_numpy(qweight), torch.from_numpy(qzeros)
    w, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, w), shifts.view(1, 1, w))
    zeros = torch.bitwise_and(zeros, mask)  # AutoGPTQ's torch path, in int32 for 8 bits
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    zeros = (zeros if bits == 8 else torch.bitwise_and(zeros, mask)).reshape(scales.shape)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, w, -1), shifts.view(1, w, 1))
    weight = torch.bitwise_and(weight, mask).reshape(-1, qweight.shape[1])
    g = torch.from_numpy(g_idx).long()
    out = torch.from_numpy(scales).float()[g] * (weight - zeros[g]).float()
    return out.numpy()


def reference_awq(qweight, qzeros, scales, group_size) -> np.ndarray:
    """[in, out] float32 from AWQ GEMM tensors: 8 nibbles per int32 across ``out``, low first,
    interleaved (0, 2, 4, 6, 1, 3, 5, 7); zeros stored as they are."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)

    def unpack(packed: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(packed)
        nibbles = torch.bitwise_right_shift(t[:, :, None], shifts[None, None, :]).to(torch.int8)
        nibbles = nibbles.view(t.shape[0], -1)
        order = torch.arange(nibbles.shape[-1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].reshape(-1)
        return torch.bitwise_and(nibbles[:, order], 15)

    weight, zeros = unpack(qweight), unpack(qzeros)
    group = weight.shape[0] if group_size == -1 else group_size
    s = torch.from_numpy(scales).float().repeat_interleave(group, dim=0)
    zeros = zeros.repeat_interleave(group, dim=0)
    return ((weight - zeros).float() * s).numpy()


def quantize(w: np.ndarray, group_size: int, sym: bool, zeros=(0, 15), bits: int = 4) -> Ints:
    """Round-to-nearest min-max quantization of a float ``[in, out]`` weight per group."""
    k, n = w.shape
    group, top = k if group_size == -1 else group_size, (1 << bits) - 1
    blocks = w.reshape(k // group, group, n)
    if sym:
        scales = (2 * np.abs(blocks).max(axis=1) / top).astype(np.float16)
        zero = np.full((k // group, n), 1 << (bits - 1))
    else:
        low, high = np.minimum(blocks.min(axis=1), 0), np.maximum(blocks.max(axis=1), 0)
        scales = ((high - low) / top).astype(np.float16)
        zero = np.clip(np.rint(-low / scales.astype(np.float32)), *zeros)
    s = scales.astype(np.float32)[:, None, :]
    codes = np.clip(np.rint(blocks / s) + zero[:, None, :], 0, top).reshape(k, n)
    return Ints(codes.astype(np.uint8), zero.astype(np.uint8), scales)


def gptq_config(group_size: int, sym: bool, checkpoint_format: str = "gptq", bits: int = 4) -> dict:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": False,
        "sym": sym,
        "checkpoint_format": checkpoint_format,
    }


def awq_config(group_size: int) -> dict:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }


def write_quantized_llama(folder: Path, quant: dict, seed: int = 0, **llama: Any) -> QuantizedModel:
    """A tiny random Llama whose layer projections are stored as ``quant`` describes."""
    import torch
    from safetensors.numpy import save_file
    from transformers import LlamaConfig

    hf_model = save_random_model(LlamaConfig(**{**TINY, **llama}), folder, seed)
    (folder / "model.safetensors").unlink()
    state = {k: v.detach().numpy().copy() for k, v in hf_model.state_dict().items()}
    group, sym = quant["group_size"], quant.get("sym", False)
    fmt = quant.get("checkpoint_format", "gptq")
    linears: dict[str, Ints] = {}
    for i in range(hf_model.config.num_hidden_layers):
        for name in LINEARS:
            prefix = f"model.layers.{i}.{name}"
            w = state.pop(f"{prefix}.weight").T
            low = 1 if quant["quant_method"] == "gptq" and fmt == "gptq" else 0
            bits = quant["bits"]
            zeros = (low, (1 << bits) - 1)
            ints = linears[prefix] = quantize(w, group, sym, zeros=zeros, bits=bits)
            if quant["quant_method"] == "gptq":
                t = pack_gptq(
                    ints.codes,
                    ints.zeros,
                    ints.scales,
                    group_size=group,
                    bits=bits,
                    checkpoint_format=fmt,
                )
                parts = {
                    "qweight": t.qweight,
                    "qzeros": t.qzeros,
                    "scales": t.scales,
                    "g_idx": t.g_idx,
                }
            else:
                t = pack_awq(ints.codes, ints.zeros, ints.scales, group_size=group)
                parts = {"qweight": t.qweight, "qzeros": t.qzeros, "scales": t.scales}
            state.update({f"{prefix}.{p}": a for p, a in parts.items()})
            module = hf_model.get_submodule(prefix)
            with torch.no_grad():
                module.weight.copy_(torch.from_numpy(dequantize(ints).T.copy()))
    _save_two_shards(folder, state, save_file)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return QuantizedModel(folder, hf_model, linears)


def _save_two_shards(folder: Path, state: dict[str, np.ndarray], save_file) -> None:
    """Keys in name order, cut in half; layer 0's q_proj qzeros moved to the other shard than
    its qweight."""
    keys = sorted(state)
    first = set(keys[: len(keys) // 2])
    straddle = "model.layers.0.self_attn.q_proj.qzeros"
    if (straddle in first) == ("model.layers.0.self_attn.q_proj.qweight" in first):
        first ^= {straddle}
    shards = {
        "model-00001-of-00002.safetensors": {k: state[k] for k in keys if k in first},
        "model-00002-of-00002.safetensors": {k: state[k] for k in keys if k not in first},
    }
    weight_map = {}
    for name, tensors in shards.items():
        # safetensors' numpy writer stores an array's memory as it lies, so lay it out in C order.
        tensors = {k: np.ascontiguousarray(a) for k, a in tensors.items()}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
