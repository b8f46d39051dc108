"""The ``finish`` steps of the architectures in ``archs_recent`` (see ``config``): what their
converters leave out of the metadata, put back as llama.cpp assumes it, and one-line errors,
naming the key, for the metadata these models do not run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_llm_runtime.runtime.loading.gguf.config import (
    GGUFModel,
    has_qkv_bias,
    rotary_fraction,
    sliding_layers,
)
from jax_llm_runtime.runtime.loading.gguf.reader import GGUFError, short_repr


def finish_gpt_oss(config: dict[str, Any], model: GGUFModel) -> None:
    """gpt-oss: llama.cpp alternates sliding and full layers, the first sliding (no key says
    so), and runs yarn rope; the ramp is not truncated, as in the released models' configs
    (the converter writes no key for it)."""
    layers = config["num_hidden_layers"]
    config["layer_types"] = [
        "sliding_attention" if sliding else "full_attention"
        for sliding in sliding_layers(model, layers, 2)
    ]
    config["attention_bias"] = has_qkv_bias(model)
    scaling = config.get("rope_scaling")
    if scaling is None:
        # Without the key the HF config would fall back to gpt-oss's own yarn, not plain rope.
        config["rope_scaling"] = {"rope_type": "default"}
    elif scaling["rope_type"] == "yarn":
        scaling["truncate"] = False


# llama.cpp's converter marks the head dims that a proportional rope leaves unturned with a
# rope_freqs factor of 1e30 (a frequency divided by it is zero); anything this large is one.
_UNTURNED = 1e29


def finish_gemma4(config: dict[str, Any], model: GGUFModel) -> None:
    """Gemma 4: the per-layer pattern of sliding and full layers; the full layers' head width
    (``key_length``; ``key_length_swa`` is the sliding layers') and KV-head count (one
    ``head_count_kv`` per layer), their values taken from their keys where they have no
    ``attn_v``; the full layers' proportional rope, which the converter writes as ``rope_freqs``
    factors; the MoE block where the file has experts; and E2B's and E4B's parts: the last
    ``shared_kv_layers`` layers reusing earlier layers' K/V, their MLPs twice as wide where
    ``feed_forward_length`` says so, and the per-layer embeddings."""
    layers = config["num_hidden_layers"]
    shared = model.get_int("attention.shared_kv_layers", 0)
    if shared >= layers:
        raise GGUFError(
            f"GGUF metadata {model.arch}.attention.shared_kv_layers={shared} leaves none of the "
            f"{layers} layers with K/V of its own"
        )
    config["num_kv_shared_layers"] = shared
    _gemma4_mlp_widths(config, model, shared)
    _gemma4_per_layer_inputs(config, model)
    sliding = sliding_layers(model, layers, 6)
    config["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in sliding]
    _gemma4_kv_heads(config, model, sliding)
    config["rope_parameters"] = {
        "full_attention": _proportional_rope(config, model),
        "sliding_attention": _gemma4_sliding_rope(config, model),
    }
    config["enable_moe_block"] = "num_experts" in config


def _gemma4_mlp_widths(config: dict[str, Any], model: GGUFModel, shared: int) -> None:
    """``intermediate_size`` and ``use_double_wide_mlp``: the converter writes
    ``feed_forward_length`` as one width per layer when the KV-sharing layers' MLPs are twice
    as wide, else as one value."""
    layers = config["num_hidden_layers"]
    widths = _per_layer_ints(model, "feed_forward_length", layers, 0)
    first = layers - shared
    doubled = [widths[0] * (2 if i >= first else 1) for i in range(layers)]
    wide = shared > 0 and widths == doubled
    if not wide and len(set(widths)) > 1:
        raise GGUFError(
            f"GGUF metadata {model.arch}.feed_forward_length {short_repr(widths)}: MLP widths "
            f"other than one width, or one width and twice it on the last {shared} "
            "(KV-sharing) layers, are not supported"
        )
    config["intermediate_size"] = widths[0]
    config["use_double_wide_mlp"] = wide


def _gemma4_per_layer_inputs(config: dict[str, Any], model: GGUFModel) -> None:
    """The per-layer embeddings' width (``embedding_length_per_layer_input``, 0: none) and the
    rows of their table, which the converter writes as ``per_layer_token_embd`` (``[vocab,
    layers * width]``) and no key."""
    key, table = "embedding_length_per_layer_input", "per_layer_token_embd.weight"
    width = model.get_int(key, 0)
    shape = model.shapes.get(table)
    config["hidden_size_per_layer_input"] = width
    columns = config["num_hidden_layers"] * width
    if shape is None and width:
        problem = f"the file has no tensor {table}"
    elif shape is not None and not width:
        problem = f"the file has tensor {table} (per-layer embeddings)"
    elif shape is not None and (len(shape) != 2 or shape[1] != columns):
        problem = f"tensor {table} has shape {shape}, not [vocab, {columns}]"
    else:
        if shape is not None:
            config["vocab_size_per_layer_input"] = shape[0]
        return
    raise GGUFError(f"GGUF metadata {model.arch}.{key}={width}, but {problem}")


def _gemma4_kv_heads(config: dict[str, Any], model: GGUFModel, sliding: list[bool]) -> None:
    heads = _per_layer_ints(
        model, "attention.head_count_kv", len(sliding), config["num_attention_heads"]
    )
    local = {n for n, flag in zip(heads, sliding, strict=True) if flag}
    full = {n for n, flag in zip(heads, sliding, strict=True) if not flag}
    if len(local) > 1 or len(full) > 1:
        raise GGUFError(
            f"{model.arch}.attention.head_count_kv {heads}: layers of one kind with different "
            "KV-head counts are not supported"
        )
    # The KV-sharing layers have no K/V projections of their own to tell by.
    own = sliding[: len(sliding) - config["num_kv_shared_layers"]]
    from_keys = any(
        f"blk.{i}.attn_v.weight" not in model.shapes for i, flag in enumerate(own) if not flag
    )
    config["attention_k_eq_v"] = from_keys
    config["num_key_value_heads"] = min(local or full)
    if local and full and full != local:
        if not from_keys:
            raise GGUFError(
                f"{model.arch} full layers with {min(full)} KV heads (sliding ones: "
                f"{min(local)}) and values of their own are not supported"
            )
        config["num_global_key_value_heads"] = min(full)


def _proportional_rope(config: dict[str, Any], model: GGUFModel) -> dict[str, Any]:
    """The full layers' rope: ``rope_freqs`` holds 1 for each turned pair of dims and 1e30 for
    the rest; without it, every pair turns."""
    width = model.get_int("attention.key_length")
    if not width:
        raise GGUFError(f"GGUF metadata {model.arch}.attention.key_length must be positive")
    factors = model.values.get("rope_freqs.weight")
    config.pop("rope_freq_factors", None)
    turned = width // 2 if factors is None else int(np.sum(factors == 1.0))
    proportional = factors is None or (
        len(factors) == width // 2 and (factors[turned:] >= _UNTURNED).all()
    )
    rotated = model.get_int("rope.dimension_count", width)
    if not proportional or rotated != width or config.pop("rope_scaling", None):
        raise GGUFError(
            f"{model.arch} full layers with rope other than proportional (rope.dimension_count "
            f"{rotated} of head width {width}, rope_freqs, rope scaling) are not supported"
        )
    theta = config.pop("rope_theta")
    return {
        "rope_type": "proportional",
        "partial_rotary_factor": 2 * turned / width,
        "rope_theta": theta,
    }


def _gemma4_sliding_rope(config: dict[str, Any], model: GGUFModel) -> dict[str, Any]:
    width = config["head_dim"]
    rotated = model.get_int("rope.dimension_count_swa", width)
    if rotated != width:
        raise GGUFError(
            f"{model.arch} sliding layers turning {rotated} of {width} head dims are not supported"
        )
    return {"rope_type": "default", "rope_theta": model.get_float("rope.freq_base_swa", 10000.0)}


# What llama.cpp hard-codes for Llama 4 files (any sliding window but 0): attention within
# chunks of 8192 positions, every 4th layer without rope and with the query temperature.
_LLAMA4_CHUNKED = {
    "attention_chunk_size": 8192,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attn_temperature_tuning": True,
}
_LLAMA4_NO_ROPE_INTERVAL = 4
_LLAMA4_MAVERICK_EXPERTS = 128  # the one Llama 4 without q/k norm, told apart by its experts


def finish_llama4(config: dict[str, Any], model: GGUFModel) -> None:
    """Llama 4: the attention pattern and q/k norm llama.cpp hard-codes (a sliding window of 0
    in the file means every layer attends to everything, with rope and without the query
    temperature); q/k/v biases read off the tensors."""
    layers = config["num_hidden_layers"]
    if model.get_int("attention.sliding_window") == 0:
        config.update(
            attention_chunk_size=None, no_rope_layers=[1] * layers, attn_temperature_tuning=False
        )
    else:
        config.update(
            _LLAMA4_CHUNKED,
            no_rope_layers=[int((i + 1) % _LLAMA4_NO_ROPE_INTERVAL != 0) for i in range(layers)],
        )
    config["use_qk_norm"] = config["num_local_experts"] != _LLAMA4_MAVERICK_EXPERTS
    config["attention_bias"] = has_qkv_bias(model)


# The ssm.* sizes the tensor plan computes with (value heads, key heads, all value heads'
# width, key head width, conv kernel).
_SSM_SIZES = ("time_step_rank", "group_count", "inner_size", "state_size", "conv_kernel")


def finish_qwen3next(config: dict[str, Any], model: GGUFModel) -> None:
    """Qwen3-Next: the value heads' width from ``ssm.inner_size`` (all value heads together;
    ``ssm.time_step_rank`` counts them), partial rotary, and the decoder layers without the
    multi-token-prediction ones (every layer has experts: llama.cpp runs no dense layers
    between them)."""
    sizes = [model.get_int(f"ssm.{key}") for key in _SSM_SIZES]
    if not all(sizes):
        raise GGUFError(
            f"GGUF metadata {', '.join(f'{model.arch}.ssm.{k}' for k in _SSM_SIZES)} must be "
            f"positive, got {sizes}"
        )
    v_heads, k_heads, inner = sizes[:3]
    if inner % v_heads or v_heads % k_heads:
        raise GGUFError(
            f"GGUF metadata: {model.arch}.ssm.inner_size {inner} does not split into "
            f"{v_heads} value heads, or those into {k_heads} key heads"
        )
    config["linear_value_head_dim"] = inner // v_heads
    config["partial_rotary_factor"] = rotary_fraction(config, model)
    config["attention_bias"] = has_qkv_bias(model)
    # Newer converters append the multi-token-prediction layers to block_count (and name how
    # many); their tensors are skipped (``tensors.plan_tensors``).
    nextn = model.get_int("nextn_predict_layers", 0)
    if nextn >= config["num_hidden_layers"]:
        raise GGUFError(
            f"GGUF metadata: {model.arch}.nextn_predict_layers is {nextn} of "
            f"{config['num_hidden_layers']} blocks"
        )
    config["num_hidden_layers"] -= nextn


def finish_qwen35(config: dict[str, Any], model: GGUFModel) -> None:
    """Qwen3.5 (dense or MoE): Qwen3-Next's sizes, and its multimodal rope with the file's
    sections (on text, where every position axis agrees, it is the plain rope)."""
    finish_qwen3next(config, model)
    rope = {
        "rope_type": "default",
        "rope_theta": config.pop("rope_theta"),
        "partial_rotary_factor": config.pop("partial_rotary_factor"),
        "mrope_interleaved": True,
    }
    if model.get("rope.dimension_sections") is not None:  # else transformers' default
        sections = _per_layer_ints(model, "rope.dimension_sections", 4, 0, minimum=0)
        rope["mrope_section"] = sections[:3]
    config["rope_parameters"] = rope


def _per_layer_ints(
    model: GGUFModel, key: str, layers: int, default: int, minimum: int = 1
) -> list[int]:
    """``<arch>.<key>`` for each layer (or each of ``layers`` items): the file's array, or its
    one value for every layer; each at least ``minimum``."""
    value = model.get(key, default)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or any(
        not isinstance(v, int) or isinstance(v, bool) or v < minimum for v in values
    ):
        raise GGUFError(
            f"GGUF metadata {model.arch}.{key} must be an integer of at least {minimum} or "
            f"{layers} of them, got {short_repr(value)}"
        )
    return values
