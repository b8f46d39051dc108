"""Gemma 4 (text): Gemma 3's layer (four norms, sliding and full layers with their own ropes,
q/k norms) with plain RMSNorm weights (not offsets from 1), an RMS norm without weight over each
head of v, an attention scale of 1, a learned scalar on each layer's output, and full layers
whose heads are wider (``global_head_dim``), whose KV heads may be fewer
(``num_global_key_value_heads``) and whose values may be their keys (``attention_k_eq_v``), on
a "proportional" rope that turns only a fraction of the head's pairs.

Every layer's heads are held at the widest width and every layer's KV heads at the largest
count, so that one layer stack and one cache shape serve all layers: the loader pads the
narrower heads with zeros (``models.layers.attention``) and repeats each of the fewer KV heads
for the query heads it serves. That costs the narrower layers' padding in memory and flops
(and, in a quantized checkpoint, float attention projections: padding moves single rows).

With ``enable_moe_block`` (Gemma 4 26B-A4B) every layer runs its dense MLP and a mixture of
experts side by side (``DecoderConfig.moe_beside_mlp``): the router reads the residual stream,
RMS-normed and scaled, picks ``top_k_experts`` by softmax, renormalises them and scales each by
its expert's learned scale.

The small models (E2B, E4B) add two things. Per-layer embeddings: a second table gives each
token one narrow input per layer, mixed with a projection of its embedding, which each layer
gates with its output and adds back (``models.layers.embed.PerLayerInputs``). KV sharing: the
last ``num_kv_shared_layers`` layers compute no K/V and attend to that of the last earlier layer
of their kind (sliding or full), so the KV cache holds only the earlier layers
(``DecoderConfig.kv_sources``); with ``use_double_wide_mlp`` their MLPs are twice as wide.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jax_llm_runtime.models import checkpoint
from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.gemma import GEMMA2_WEIGHT_RULES
from jax_llm_runtime.models.families.llama import LAYER, sliding_flags
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.layers.moe import MoEConfig
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.layers.rotary import rope_from_hf
from jax_llm_runtime.models.state import ModelWeights
from jax_llm_runtime.models.weights import WeightRule, nested_rules
from jax_llm_runtime.pallas_kernels.dequant_matmul import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.host import dequantize_host, split_out

_LAYER = r"model\.(?:language_model\.)?layers\.(\d+)\."
# Fields whose value, when set, is a part of Gemma 4 this runtime does not run.
_REFUSED = {"attention_bias": "attention biases"}
_LAYER_OVERRIDES = {"head_dim", "num_key_value_heads"}


def _refuse_unsupported(text: dict[str, Any]) -> None:
    for field, what in _REFUSED.items():
        if text.get(field):
            raise ValueError(f"Gemma 4 {what} ({field}={text[field]!r}) are not supported")
    if text.get("use_bidirectional_attention") == "all":
        raise ValueError(
            "Gemma 4 with use_bidirectional_attention='all' (an encoder) cannot generate"
        )


def _layer_types(text: dict[str, Any], num_layers: int) -> list[str]:
    """``layer_types``, else five sliding layers to one full; the last layer is always full."""
    types = list(
        text.get("layer_types")
        or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    )
    if types:
        types[-1] = "full_attention"
    return types


def _kv_sources(text: dict[str, Any], types: list[str]) -> tuple[int, ...]:
    """Each layer's K/V source (``DecoderConfig.kv_sources``): the last ``num_kv_shared_layers``
    layers reuse the last earlier layer of their kind; empty when none do."""
    n, shared = len(types), int(text.get("num_kv_shared_layers") or 0)
    if not shared:
        return ()
    first = n - shared
    sources = list(range(n))
    for i in range(first, n):
        own = [j for j in range(first) if types[j] == types[i]]
        if not own:
            raise ValueError(
                f"Gemma 4 num_kv_shared_layers={shared} leaves no earlier {types[i]} layer "
                f"for layer {i} to reuse"
            )
        sources[i] = own[-1]
    return tuple(sources)


def _full_layer_shape(text: dict[str, Any], types: list[str]) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) of the full layers: ``per_layer_config`` when the config
    lists it (transformers' saved form), else ``global_head_dim`` and, with attention_k_eq_v,
    ``num_global_key_value_heads``."""
    kv = int(text["num_key_value_heads"])
    local = int(text["head_dim"]), kv
    overrides = text.get("per_layer_config")
    if overrides is not None:
        # transformers writes the layer keys zero-padded to one width ("04" of 35 layers).
        overrides = {int(layer): fields for layer, fields in overrides.items()}
    if overrides is None:
        global_kv = text.get("num_global_key_value_heads") if text.get("attention_k_eq_v") else None
        return int(text.get("global_head_dim", 512)), int(global_kv or kv)
    shapes = set()
    for i, kind in enumerate(types):
        layer = overrides.get(i) or {}
        if set(layer) - _LAYER_OVERRIDES:
            raise ValueError(
                f"Gemma 4 per_layer_config sets {sorted(set(layer) - _LAYER_OVERRIDES)}"
            )
        shape = int(layer.get("head_dim", local[0])), int(layer.get("num_key_value_heads", kv))
        if kind == "sliding_attention" and shape != local:
            raise ValueError(f"Gemma 4 per_layer_config reshapes sliding layer {i}")
        if kind == "full_attention":
            shapes.add(shape)
    if len(shapes) != 1:
        raise ValueError(f"Gemma 4 full layers of different shapes {sorted(shapes)}")
    return shapes.pop()


def gemma4_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Gemma 4 text, or the ``text_config`` of a multimodal Gemma 4 checkpoint."""
    text = hf.get("text_config") or hf
    _refuse_unsupported(text)
    num_layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
    types = _layer_types(text, num_layers)
    slides = sliding_flags(types, num_layers)
    local_dim, local_kv = int(text["head_dim"]), int(text["num_key_value_heads"])
    full_dim, full_kv = _full_layer_shape(text, types)
    sliding = any(slides)
    kv = max(local_kv, full_kv) if sliding else full_kv
    if kv % (min(local_kv, full_kv) if sliding else kv) or heads % kv:
        raise ValueError(
            f"Gemma 4 KV heads {local_kv} (sliding) and {full_kv} (full) must divide each other "
            f"and num_attention_heads {heads}"
        )
    ropes = text.get("rope_parameters") or {}
    base = {"max_position_embeddings": text.get("max_position_embeddings")}
    full_rope = rope_from_hf({**base, "rope_parameters": ropes["full_attention"]}, full_dim)
    local_rope = rope_from_hf({**base, "rope_parameters": ropes["sliding_attention"]}, local_dim)
    eps = float(text.get("rms_norm_eps", 1e-6))
    head_dim = max(local_dim, full_dim) if sliding else full_dim
    moe = _moe(text, eps) if text.get("enable_moe_block") else None
    sources = _kv_sources(text, types)
    inter = int(text["intermediate_size"])
    wide = bool(text.get("use_double_wide_mlp")) and bool(sources)
    sizes = tuple(inter * (2 if s != i else 1) for i, s in enumerate(sources)) if wide else ()
    per_layer = int(text.get("hidden_size_per_layer_input") or 0)
    return llama_like(
        {**text, "rope_parameters": None, "rope_scaling": None, "head_dim": head_dim},
        attention={
            "num_kv_heads": kv,
            "rope": full_rope,
            "local_rope": local_rope if sliding else None,
            "softmax_scale": 1.0,
            "sliding_window": int(text["sliding_window"]) if sliding else None,
            "qk_norm": NormConfig("rms", eps),
            "v_norm": NormConfig("rms", eps),
            "head_dims": (local_dim, full_dim) if sliding and local_dim != full_dim else None,
            "full_values_from_keys": bool(text.get("attention_k_eq_v")),
        },
        norm=NormConfig("rms", eps),
        activation=text.get("hidden_activation") or "gelu_pytorch_tanh",
        embed_scale=float(text["hidden_size"]) ** 0.5,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sandwich_norms=True,
        final_soft_cap=text.get("final_logit_softcapping"),
        sliding_layers=slides if sliding else (),
        layer_scalar=True,
        moe=moe,
        moe_beside_mlp=moe is not None,
        kv_sources=sources,
        layer_intermediate_sizes=sizes,
        per_layer_input_size=per_layer,
        per_layer_vocab_size=int(text.get("vocab_size_per_layer_input") or 0) if per_layer else 0,
    )


def _moe(text: dict[str, Any], eps: float) -> MoEConfig:
    return MoEConfig(
        num_experts=int(text["num_experts"]),
        top_k=int(text["top_k_experts"]),
        expert_intermediate_size=int(text["moe_intermediate_size"]),
        norm_topk_prob=True,
        activation=text.get("hidden_activation") or "gelu_pytorch_tanh",
        router_norm=NormConfig("rms", eps),
        expert_scale=True,
    )


def _layer_head_dim(cfg: DecoderConfig, layer: int) -> int:
    """Layer ``layer``'s real head width in the checkpoint."""
    att = cfg.attention
    if att.head_dims is None:
        return att.head_dim
    return att.head_dims[0 if cfg.sliding_layers and cfg.sliding_layers[layer] else 1]


def _widened(
    rows: np.ndarray,  # [heads * width, ...]: a torch projection's output rows, or a norm
    width: int,
    head_dim: int,
    repeat: int = 1,
) -> np.ndarray:  # [heads * repeat * head_dim, ...]
    """Each head's rows zero-padded from ``width`` to ``head_dim``, each head repeated."""
    heads = rows.reshape(-1, width, *rows.shape[1:])
    pad = [(0, 0), (0, head_dim - width)] + [(0, 0)] * (rows.ndim - 1)
    heads = np.repeat(np.pad(heads, pad), repeat, axis=0)
    return heads.reshape(-1, *rows.shape[1:])


def _uniform_heads(
    cfg: DecoderConfig, tensors: Iterable[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with every layer's attention at the widest head and the largest
    KV-head count (see the module docstring); a full layer whose values are its keys also gets
    its ``k_proj`` as its ``v_proj``."""
    att = cfg.attention
    for name, value in tensors:
        match = _ATTENTION.fullmatch(name)
        if match is None:
            yield from _expert_stacks(name, value)
            continue
        layer, kind = int(match[1]), match[2]
        if cfg.reuses_kv(layer) and kind in ("k_proj", "v_proj", "k_norm"):
            continue  # a layer that reuses another's K/V: its own (if saved) are never read
        width = _layer_head_dim(cfg, layer)
        repeat = 1
        if kind in ("k_proj", "v_proj"):
            repeat = att.num_kv_heads * width // _rows(value)
        if width != att.head_dim or repeat != 1:
            value = _widen(value, kind, width, att.head_dim, repeat)
        yield name, value
        full = not (cfg.sliding_layers and cfg.sliding_layers[layer])
        if kind == "k_proj" and full and att.full_values_from_keys:
            yield name.replace("k_proj", "v_proj"), value


def _expert_stacks(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """A MoE layer's torch-layout expert stacks as ``[experts, in, out]``: the fused
    ``gate_up_proj`` ([experts, 2 * inter, hidden], gate first) cut into ``gate_proj`` and
    ``up_proj``, and ``down_proj``; any other tensor as it is. A quantized stack (a GGUF
    file's) is ``[experts, in, out]`` already."""
    kind = _EXPERTS.fullmatch(name)
    if kind is None:
        yield name, value
        return
    packed = isinstance(value, HostPacked)
    stack = value if packed else np.swapaxes(np.asarray(value), 1, 2)
    if kind[2] == "down_proj":
        yield name, stack
        return
    if packed:
        half = stack.codes.shape[-1] // 2
        gate, up = split_out(stack, [half, half])
    else:
        gate, up = np.split(stack, 2, axis=-1)
    yield name.replace("gate_up_proj", "gate_proj"), gate
    yield name.replace("gate_up_proj", "up_proj"), up


def _rows(value: Any) -> int:
    return value.codes.shape[-1] if isinstance(value, HostPacked) else value.shape[0]


def _widen(value: Any, kind: str, width: int, head_dim: int, repeat: int) -> Any:
    if isinstance(value, HostPacked):
        # Padding moves single rows, which quantized blocks cannot: a quantized checkpoint's
        # (a GGUF file's) attention is dequantized, and its fields are float in every layer.
        value = np.swapaxes(dequantize_host(value), -1, -2)
    value = np.asarray(value)
    if kind == "o_proj":  # [hidden, heads * width]: heads along the input
        return _widened(value.T, width, head_dim).T
    return _widened(value, width, head_dim, repeat)


def load(
    cfg: DecoderConfig,
    tensors: Iterable[tuple[str, Any]],
    dtype: Any,
    num_tensors: int | None = None,
    *,
    rules: tuple[WeightRule, ...],
) -> ModelWeights:
    """``models.checkpoint.load`` of the tensors made uniform (``_uniform_heads``)."""
    return checkpoint.load(cfg, _uniform_heads(cfg, tensors), dtype, num_tensors, rules=rules)


_ATTENTION = re.compile(_LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight")
_EXPERTS = re.compile(_LAYER + r"experts\.(gate_up_proj|down_proj)")
GEMMA4_WEIGHT_RULES = (
    *GEMMA2_WEIGHT_RULES,
    WeightRule(LAYER + r"layer_scalar", "layer_scalar", per_layer=True),
    WeightRule(LAYER + r"router\.proj\.weight", "router", transpose=True, per_layer=True),
    WeightRule(LAYER + r"router\.scale", "router_scale", per_layer=True),
    WeightRule(LAYER + r"router\.per_expert_scale", "expert_scale", per_layer=True),
    # The transposed stacks of ``_expert_stacks``.
    WeightRule(LAYER + r"experts\.gate_proj", "e_gate", per_layer=True),
    WeightRule(LAYER + r"experts\.up_proj", "e_up", per_layer=True),
    WeightRule(LAYER + r"experts\.down_proj", "e_down", per_layer=True),
    WeightRule(LAYER + r"post_feedforward_layernorm_1\.weight", "mlp_post_norm_1", per_layer=True),
    WeightRule(LAYER + r"pre_feedforward_layernorm_2\.weight", "moe_norm", per_layer=True),
    WeightRule(LAYER + r"post_feedforward_layernorm_2\.weight", "moe_post_norm", per_layer=True),
    # Per-layer embeddings.
    WeightRule(r"model\.embed_tokens_per_layer\.weight", "ple_embed"),
    WeightRule(r"model\.per_layer_model_projection\.weight", "ple_proj", transpose=True),
    WeightRule(r"model\.per_layer_projection_norm\.weight", "ple_norm"),
    WeightRule(LAYER + r"per_layer_input_gate\.weight", "ple_gate", transpose=True, per_layer=True),
    WeightRule(LAYER + r"per_layer_projection\.weight", "ple_out", transpose=True, per_layer=True),
    WeightRule(LAYER + r"post_per_layer_input_norm\.weight", "ple_post_norm", per_layer=True),
)
GEMMA4_MULTIMODAL_WEIGHT_RULES = nested_rules(
    GEMMA4_WEIGHT_RULES,
    "language_model",
    r"model\.(vision_tower|audio_tower|embed_vision|embed_audio)\..*",
)
