"""Write a tiny HF model as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does (test side).

The tensor names come from gguf's own ``TensorNameMap`` and the metadata keys from
``GGUFWriter.add_*``; the converter's transforms are redone here from its description: the llama
q/k row interleave, Gemma's ``norm + 1``, experts and StableLM's per-head norms stacked into one
tensor, DeepSeek's kv_b_proj split into a transposed k_b and a v_b, gpt-oss's expert stacks
transposed to rows with gate and up split apart, Gemma 4's proportional rope and Llama 3's rope
scaling as ``rope_freqs``, Phi-3's longrope factors as tensors, Qwen3-Next's linear
attention as llama.cpp's ssm_* tensors (Qwen3.5's value heads tiled). Nothing here reads
``runtime.gguf_*``, so loading the file back is an independent round trip.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES

from jax_llm_runtime.pallas_kernels.dequant_matmul.quantize import QUANT_TYPES, quantize_rows
from tests.models.gguf_writer_metadata import (
    deepseek_metadata,
    gemma2_metadata,
    gemma3_metadata,
    gemma4_full_layers,
    gemma4_metadata,
    glm4_metadata,
    glm4_moe_metadata,
    gpt_oss_metadata,
    head_dim_of,
    llama4_metadata,
    llama_metadata,
    minimax_m2_metadata,
    moe_metadata,
    phi3_metadata,
    qwen3next_metadata,
    qwen35_metadata,
    rope_parameters,
    stablelm_metadata,
    text_metadata,
)

_SUFFIXES = (".weight", ".bias")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_HEAD_NORM = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qk]_layernorm)\.norms\.(\d+)\.weight")
# Tensors the converter keeps in float32 whatever the output type (llama.cpp quantizes weights
# only, so gpt-oss's [experts, out] biases stay float too).
_F32_TENSORS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", ".bias")

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class _Arch:
    """One converter class: the GGUF architecture, its metadata step and its tensor steps."""

    gguf_arch: gguf.MODEL_ARCH
    metadata: Callable[[gguf.GGUFWriter, dict[str, Any]], None]
    tensors: Callable[[Tensors, dict[str, Any]], Tensors]
    extra: Callable[[dict[str, Any]], Tensors] = lambda hp: {}


def write_gguf(
    model_or_state_dict: Any,
    hf_config: Any,
    path: Path,
    *,
    split_into: int | None = None,
    qtype: str | Callable[[str], str] = "f32",
    fuse_qkv: bool = False,
    split_kv_b: bool = True,
    fuse_gate_up_exps: bool = False,
) -> list[Path]:
    """Convert a float32 HF model (or its on-disk state dict) to GGUF; return the files written.

    ``split_into`` writes that many gguf-split shards (``<stem>-00001-of-0000N.gguf`` ...).
    ``qtype`` ("f32", "f16", a block type of ``QUANT_TYPES``: "q8_0", "q4k" ..., or "mxfp4"; or
    a function of the GGUF tensor name giving one) is the type of the matrices; norms, routers and vectors
    stay float32 as the converter keeps them. ``fuse_qkv`` mimics ``--fuse-qkv``,
    ``fuse_gate_up_exps`` ``--fuse-gate-up-exps`` (gate rows then up rows in one stack); ``split_kv_b=False``
    writes DeepSeek's older single ``attn_kv_b``. No tokenizer is written.
    """
    hp = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    # A model not yet saved has no "architectures"; its class says the same.
    names = hp.get("architectures") or [type(model_or_state_dict).__name__]
    arch = _ARCHS[names[0]]
    if not split_kv_b:
        if arch.gguf_arch != gguf.MODEL_ARCH.DEEPSEEK2:
            raise ValueError("split_kv_b=False only applies to DeepSeek models")
        arch = _Arch(
            arch.gguf_arch,
            partial(deepseek_metadata, split_kv_b=False),
            partial(_deepseek_tensors, split_kv_b=False),
        )
    state = _state_dict(model_or_state_dict)
    tensors = {**arch.extra(hp), **_gguf_names(arch, arch.tensors(state, hp), hp)}
    if fuse_qkv:
        tensors = _fuse_qkv(tensors)
    if fuse_gate_up_exps:
        tensors = _fuse_gate_up_exps(tensors)
    per_shard = math.ceil(len(tensors) / split_into) if split_into else 0
    writer = gguf.GGUFWriter(
        path, gguf.MODEL_ARCH_NAMES[arch.gguf_arch], split_max_tensors=per_shard
    )
    arch.metadata(writer, hp)
    for name, array in tensors.items():
        _add_tensor(writer, name, array, qtype)
    files = writer.format_shard_names(Path(path))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_into and len(files) != split_into:
        raise ValueError(f"{len(tensors)} tensors do not make {split_into} shards")
    return files


def _state_dict(model_or_state_dict: Any) -> Tensors:
    if hasattr(model_or_state_dict, "save_pretrained"):
        from safetensors.numpy import load_file

        # save_pretrained writes the on-disk names (per-expert tensors) the converter reads.
        with tempfile.TemporaryDirectory() as folder:
            model_or_state_dict.save_pretrained(folder)
            return {
                k: v for f in Path(folder).glob("*.safetensors") for k, v in load_file(f).items()
            }
    return {
        name: np.asarray(t.detach().float().numpy() if hasattr(t, "detach") else t, np.float32)
        for name, t in model_or_state_dict.items()
    }


def _gguf_names(arch: _Arch, tensors: Tensors, hp: dict[str, Any]) -> Tensors:
    name_map = gguf.get_tensor_name_map(arch.gguf_arch, hp["num_hidden_layers"])
    out = {}
    for name, array in tensors.items():
        if name.startswith("blk."):  # named by the tensor step already
            out[name] = array
            continue
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        new = name_map.get_name(name, try_suffixes=_SUFFIXES)
        if new is None:
            raise ValueError(f"gguf has no name for {name!r} in {arch.gguf_arch.name}")
        out[new] = array
    return out


def _fuse_qkv(tensors: Tensors) -> Tensors:
    out = {}
    for name, array in tensors.items():
        if match := re.fullmatch(r"(blk\.\d+\.)attn_q(\.weight|\.bias)", name):
            parts = [tensors[f"{match[1]}attn_{x}{match[2]}"] for x in "qkv"]
            out[f"{match[1]}attn_qkv{match[2]}"] = np.concatenate(parts, axis=0)
        elif not re.fullmatch(r"blk\.\d+\.attn_[kv](\.weight|\.bias)", name):
            out[name] = array
    return out


def _fuse_gate_up_exps(tensors: Tensors) -> Tensors:
    """Each layer's gate and up expert stacks as one: gate rows then up rows (biases: gate
    values then up values)."""
    out = {}
    for name, array in tensors.items():
        if match := re.fullmatch(r"(blk\.\d+\.)ffn_gate_exps(\.weight|\.bias)", name):
            up = tensors[f"{match[1]}ffn_up_exps{match[2]}"]
            axis = -2 if match[2] == ".weight" else -1
            out[f"{match[1]}ffn_gate_up_exps{match[2]}"] = np.concatenate([array, up], axis=axis)
        elif not re.fullmatch(r"blk\.\d+\.ffn_up_exps(\.weight|\.bias)", name):
            out[name] = array
    return out


def _add_tensor(
    writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: str | Callable[[str], str]
) -> None:
    array = np.ascontiguousarray(array, dtype=np.float32)
    kind = qtype(name) if callable(qtype) else qtype
    if kind == "f32" or array.ndim < 2 or name.endswith(_F32_TENSORS):
        writer.add_tensor(name, array)
        return
    if kind == "mxfp4":  # llama.cpp's own MXFP4 quantizer, which gguf.quants mirrors
        mxfp4 = gguf.GGMLQuantizationType.MXFP4
        writer.add_tensor(name, gguf.quants.quantize(array, mxfp4), raw_dtype=mxfp4)
        return
    block_type = QUANT_TYPES.get(kind)
    # Rows that do not split into the type's blocks: the converter falls back to F16.
    if kind == "f16" or array.shape[-1] % GGML_QUANT_SIZES[block_type][0]:
        writer.add_tensor(name, array.astype(np.float16))
        return
    rows = quantize_rows(array.reshape(-1, array.shape[-1]), block_type)
    writer.add_tensor(name, rows.reshape(*array.shape[:-1], -1), raw_dtype=block_type)


def _unchanged(state: Tensors, hp: dict[str, Any]) -> Tensors:
    return dict(state)


def _interleave_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Within each head, HF keeps the rotary halves apart; llama.cpp wants pairs adjacent."""
    shape = weight.shape
    return (
        weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _llama_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    out = {}
    for name, array in state.items():
        if re.search(r"\.q_proj\.(weight|bias)$", name):
            array = _interleave_rope_rows(array, hp["num_attention_heads"])
        elif re.search(r"\.k_proj\.(weight|bias)$", name):
            array = _interleave_rope_rows(array, hp["num_key_value_heads"])
        out[name] = array
    return _stack_experts(out, mixtral=True)


def _stack_experts(state: Tensors, mixtral: bool = False) -> Tensors:
    out: Tensors = {}
    groups: dict[str, dict[int, np.ndarray]] = {}
    for name, array in state.items():
        if match := _EXPERT.fullmatch(name):
            layer, _, expert, which = match.groups()
            merged = (
                f"layers.{layer}.feed_forward.experts.{which}.weight"
                if mixtral
                else f"model.layers.{layer}.mlp.experts.{which}.weight"
            )
            groups.setdefault(merged, {})[int(expert)] = array
        else:
            out[name] = array
    for merged, experts in groups.items():
        out[merged] = np.stack([experts[e] for e in range(len(experts))])
    return out


def _gemma_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    # llama.cpp scales by the stored norm weight, HF by 1 + weight.
    return {
        name: array + np.float32(1.0) if name.endswith("norm.weight") else array
        for name, array in state.items()
    }


def _gemma2_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    # Gemma 2 is always tied; the converter drops a stray lm_head.
    return _gemma_tensors({k: v for k, v in state.items() if k != "lm_head.weight"}, hp)


def _moe_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    return _stack_experts(state)


def _mixtral_experts(state: Tensors, hp: dict[str, Any]) -> Tensors:
    return _stack_experts(state, mixtral=True)


def _glm4_moe_nextn_layers(hp: dict[str, Any]) -> Tensors:
    """The converter's next-token-prediction layers after the last decoder layer: transformers
    builds none, so a few of their tensors are made up here for the loader to skip."""
    h, first = hp["hidden_size"], hp["num_hidden_layers"]
    rng = np.random.default_rng(0)
    out = {}
    for layer in range(first, first + (hp.get("num_nextn_predict_layers") or 0)):
        out[f"blk.{layer}.nextn.eh_proj.weight"] = rng.standard_normal((h, 2 * h), np.float32)
        for norm in ("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm", "attn_norm"):
            out[f"blk.{layer}.{norm}.weight"] = np.ones(h, np.float32)
    return out


def _stablelm_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    out, norms = {}, {}
    for name, array in state.items():
        if match := _HEAD_NORM.fullmatch(name):
            key = f"model.layers.{match[1]}.self_attn.{match[2]}.weight"
            norms.setdefault(key, {})[int(match[3])] = array
        else:
            out[name] = array
    out.update({k: np.stack([v[h] for h in range(len(v))]) for k, v in norms.items()})
    return out


def _deepseek_tensors(state: Tensors, hp: dict[str, Any], split_kv_b: bool = True) -> Tensors:
    out = {}
    heads, nope, v_dim = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
    for name, array in _stack_experts(state).items():
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            per_head = array.reshape(heads, nope + v_dim, array.shape[-1])
            out[name.replace("kv_b_proj", "k_b_proj")] = per_head[:, :nope].transpose(0, 2, 1)
            out[name.replace("kv_b_proj", "v_b_proj")] = per_head[:, nope:]
        else:
            out[name] = array
    return out


def _gpt_oss_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    """gpt-oss's ``[experts, in, out]`` stacks as ggml rows ``[experts, out, in]``, the
    interleaved gate and up columns split into two stacks (and their biases likewise); the
    sinks get a ``.weight`` name."""
    out = {}
    for name, array in state.items():
        stem = name.rsplit(".", 1)[0] + "."
        if name.endswith("self_attn.sinks"):
            out[name + ".weight"] = array
        elif name.endswith("experts.gate_up_proj"):
            rows = np.swapaxes(array, -1, -2)
            out[stem + "gate_proj.weight"] = rows[:, ::2]
            out[stem + "up_proj.weight"] = rows[:, 1::2]
        elif name.endswith("experts.gate_up_proj_bias"):
            out[stem + "gate_proj.bias"] = array[:, ::2]
            out[stem + "up_proj.bias"] = array[:, 1::2]
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = np.swapaxes(array, -1, -2)
        elif name.endswith("experts.down_proj_bias"):
            out[stem + "down_proj.bias"] = array
        else:
            out[name] = array
    return out


def _llama4_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    """Llama 4's ``[experts, in, out]`` stacks as ggml rows, the fused gate and up (gate
    first) split in two."""
    out = {}
    for name, array in state.items():
        stem = name.rsplit(".", 1)[0] + "."
        if name.endswith("experts.gate_up_proj"):
            gate, up = np.split(np.swapaxes(array, -1, -2), 2, axis=-2)
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = np.swapaxes(array, -1, -2)
        else:
            out[name] = array
    return out


def _qwen3next_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    """Qwen3-Next: experts stacked; the linear attention's A_log as -exp(A_log), dt_bias as
    dt_proj.bias, the conv kernel squeezed, in_proj_qkvz (per key head: q, k, v, z) as attn_qkv
    (all q, all k, all v) and attn_gate; every other norm as 1 + w; the MTP head left out."""
    k_heads, k_dim = hp["linear_num_key_heads"], hp["linear_key_head_dim"]
    out = {}
    for name, array in _stack_experts(state).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.startswith("mtp."):
            continue
        if name.endswith("in_proj_qkvz.weight"):
            heads = array.reshape(k_heads, -1, array.shape[-1])
            v_width = (heads.shape[1] - 2 * k_dim) // 2
            q, k, v, z = np.split(heads, np.cumsum([k_dim, k_dim, v_width]), axis=1)
            rows = [part.reshape(-1, array.shape[-1]) for part in (q, k, v)]
            out[f"blk.{layer}.attn_qkv.weight"] = np.concatenate(rows)
            out[f"blk.{layer}.attn_gate.weight"] = z.reshape(-1, array.shape[-1])
        elif name.endswith(".A_log"):
            out[name] = -np.exp(array)
        elif name.endswith(".dt_bias"):
            out[name.replace("dt_bias", "dt_proj.bias")] = array
        elif name.endswith("conv1d.weight"):
            out[name] = array[:, 0, :]
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            out[name] = array + np.float32(1.0)
        else:
            out[name] = array
    return out


def _tile_v_heads(
    array: np.ndarray, offset: int, k_heads: int, head_dim: int, axis: int = 0
) -> np.ndarray:
    """Qwen3.5's value heads (after ``offset`` along ``axis``) from grouped by key head to
    tiled: one of each group, then the next one of each."""
    moved = np.moveaxis(array, axis, 0)
    head, tail = moved[:offset], moved[offset:]
    rest = tail.shape[1:]
    tail = tail.reshape(k_heads, -1, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(np.concatenate([head, tail]), 0, axis)


def _qwen35_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    """Qwen3.5: Qwen3-Next's steps on separate projections (in_proj_qkv, _z, _b, _a), every
    tensor's value heads tiled when there are more of them than key heads."""
    k_heads, k_dim = hp["linear_num_key_heads"], hp["linear_key_head_dim"]
    v_dim = hp["linear_value_head_dim"]
    tiled = k_heads != hp["linear_num_value_heads"]
    places = {  # name ending -> (offset, head width, axis) of its value heads
        "in_proj_qkv.weight": (2 * k_heads * k_dim, v_dim, 0),
        "in_proj_z.weight": (0, v_dim, 0),
        "in_proj_b.weight": (0, 1, 0),
        "in_proj_a.weight": (0, 1, 0),
        ".A_log": (0, 1, 0),
        ".dt_bias": (0, 1, 0),
        "conv1d.weight": (2 * k_heads * k_dim, v_dim, 0),
        "out_proj.weight": (0, v_dim, 1),
    }
    out = {}
    for name, array in state.items():
        place = next((p for end, p in places.items() if name.endswith(end)), None)
        if tiled and "linear_attn." in name and place is not None:
            array = _tile_v_heads(array, place[0], k_heads, place[1], place[2])
        out[name] = array
    return _qwen3next_tensors(out, hp)


def _gemma4_tensors(state: Tensors, hp: dict[str, Any]) -> Tensors:
    """Gemma 4: the layer scalar and the expert stacks get a ``.weight`` name; the router's
    two scales go to llama.cpp's names for them (no HF name maps there). The per-layer
    embeddings (E2B, E4B) pass as they are: gguf's map names them, and llama.cpp scales the
    table as HF does, when it runs."""
    out = {}
    for name, array in state.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("router.scale"):
            out[f"blk.{layer}.ffn_gate_inp.scale"] = array
        elif name.endswith("router.per_expert_scale"):
            out[f"blk.{layer}.ffn_down_exps.scale"] = array
        elif name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
            out[name + ".weight"] = array
        else:
            out[name] = array
    return out


def _gemma4_rope_freqs(hp: dict[str, Any]) -> Tensors:
    """The full layers' proportional rope as ggml's rope can run it: a factor of 1 for each
    turned pair of dims, 1e30 (a zero frequency) for the rest."""
    width, _ = gemma4_full_layers(hp)
    full, _ = rope_parameters(hp)
    turned = int(width * full.get("partial_rotary_factor", 1.0) / 2)
    factors = np.float32([1.0] * turned + [1e30] * (width // 2 - turned))
    return {gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight": factors}


def _llama3_rope_freqs(hp: dict[str, Any]) -> Tensors:
    full, _ = rope_parameters(hp)
    if full.get("rope_type") != "llama3":
        return {}
    dim = head_dim_of(hp)
    freqs = 1.0 / (full["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = full["factor"], full["low_freq_factor"], full["high_freq_factor"]
    old = full["original_max_position_embeddings"]
    factors = []
    for wavelen in 2 * math.pi / freqs:
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight": np.float32(factors)}


def _phi3_rope_factors(hp: dict[str, Any]) -> Tensors:
    full, _ = rope_parameters(hp)
    if not full.get("long_factor"):
        return {}
    names = gguf.TENSOR_NAMES
    return {
        names[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight": np.float32(full["long_factor"]),
        names[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight": np.float32(full["short_factor"]),
    }


_A = gguf.MODEL_ARCH
_ARCHS = {
    "LlamaForCausalLM": _Arch(_A.LLAMA, llama_metadata, _llama_tensors, _llama3_rope_freqs),
    "MixtralForCausalLM": _Arch(_A.LLAMA, llama_metadata, _llama_tensors),
    "Qwen2ForCausalLM": _Arch(_A.QWEN2, text_metadata, _unchanged),
    "Qwen3ForCausalLM": _Arch(_A.QWEN3, text_metadata, _unchanged),
    "Qwen2MoeForCausalLM": _Arch(_A.QWEN2MOE, moe_metadata, _moe_tensors),
    "Qwen3MoeForCausalLM": _Arch(_A.QWEN3MOE, moe_metadata, _moe_tensors),
    "Phi3ForCausalLM": _Arch(_A.PHI3, phi3_metadata, _unchanged, _phi3_rope_factors),
    "Gemma2ForCausalLM": _Arch(_A.GEMMA2, gemma2_metadata, _gemma2_tensors),
    "Gemma3ForCausalLM": _Arch(_A.GEMMA3, gemma3_metadata, _gemma_tensors),
    "StableLmForCausalLM": _Arch(_A.STABLELM, stablelm_metadata, _stablelm_tensors),
    "Glm4ForCausalLM": _Arch(_A.GLM4, glm4_metadata, _unchanged),
    "Glm4MoeForCausalLM": _Arch(
        _A.GLM4_MOE, glm4_moe_metadata, _moe_tensors, _glm4_moe_nextn_layers
    ),
    "MiniMaxM2ForCausalLM": _Arch(_A.MINIMAXM2, minimax_m2_metadata, _mixtral_experts),
    "GptOssForCausalLM": _Arch(_A.GPT_OSS, gpt_oss_metadata, _gpt_oss_tensors),
    "Llama4ForCausalLM": _Arch(_A.LLAMA4, llama4_metadata, _llama4_tensors, _llama3_rope_freqs),
    "Qwen3NextForCausalLM": _Arch(_A.QWEN3NEXT, qwen3next_metadata, _qwen3next_tensors),
    "Qwen3_5ForCausalLM": _Arch(_A.QWEN35, qwen35_metadata, _qwen35_tensors),
    "Qwen3_5MoeForCausalLM": _Arch(_A.QWEN35MOE, qwen35_metadata, _qwen35_tensors),
    "Gemma4ForCausalLM": _Arch(_A.GEMMA4, gemma4_metadata, _gemma4_tensors, _gemma4_rope_freqs),
    "DeepseekV2ForCausalLM": _Arch(_A.DEEPSEEK2, deepseek_metadata, _deepseek_tensors),
    "DeepseekV3ForCausalLM": _Arch(_A.DEEPSEEK2, deepseek_metadata, _deepseek_tensors),
    # llama.cpp converts GLM-4-MoE-lite as a DeepSeek V2/V3 model.
    "Glm4MoeLiteForCausalLM": _Arch(_A.DEEPSEEK2, deepseek_metadata, _deepseek_tensors),
}
