"""Llama 4 (text): Llama's layer with interleaved rope, where every ``no_rope_layer_interval``-th
layer skips rope and attends to everything with a position-dependent query temperature, and
the others attend within fixed chunks of ``attention_chunk_size`` positions and norm q and k
after rope (an RMS norm without weight, with ``use_qk_norm``). The feed-forward block of the
``moe_layers`` is a mixture of experts with one shared expert: each token goes to its top
expert by router logit, times the sigmoid of that logit, which scales the expert's input.

The chunked layers' mask runs on the attention reference (``pallas_kernels.paged_attention.ops``):
no kernel has it. MoE layers may alternate with dense ones (``interleave_moe_layer_step`` > 1,
as in Llama 4 Maverick): each run of alike layers is a segment of its own. The multimodal
checkpoint loads its text model and skips the vision model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jax_llm_runtime.models import checkpoint
from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import ATTENTION_RULES, GLOBAL_RULES, LAYER
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.layers.moe import MoEConfig
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.state import ModelWeights
from jax_llm_runtime.models.weights import WeightRule
from jax_llm_runtime.pallas_kernels.dequant_matmul import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.host import split_out

_LAYER_TYPES = ("chunked_attention", "full_attention")


def _rope_flags(text: dict[str, Any], num_layers: int) -> list[bool]:
    """Whether each layer has rope (transformers' ``no_rope_layers``: 1 where it has)."""
    interval = int(text.get("no_rope_layer_interval", 4))
    flags = text.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return [bool(f) for f in flags]


def _chunked_flags(text: dict[str, Any], rotates: list[bool]) -> list[bool]:
    chunk = text.get("attention_chunk_size")
    types = text.get("layer_types") or [
        "chunked_attention" if r and chunk else "full_attention" for r in rotates
    ]
    if len(types) != len(rotates) or set(types) - set(_LAYER_TYPES):
        raise ValueError(f"layer_types must name one of {_LAYER_TYPES} per layer, got {types}")
    chunked = [t == "chunked_attention" for t in types]
    if any(chunked) and not chunk:
        raise ValueError("chunked_attention layers need attention_chunk_size")
    return chunked


def _moe(text: dict[str, Any]) -> tuple[MoEConfig, tuple[bool, ...]]:
    """The experts, and which layers have them (``moe_layers``, else every
    ``interleave_moe_layer_step``-th)."""
    num_layers, step = int(text["num_hidden_layers"]), int(text.get("interleave_moe_layer_step", 1))
    moe_layers = text.get("moe_layers")
    if moe_layers is None:
        moe_layers = range(step - 1, num_layers, step)
    inter = int(text["intermediate_size"])
    moe = MoEConfig(
        num_experts=int(text["num_local_experts"]),
        top_k=int(text.get("num_experts_per_tok", 1)),
        expert_intermediate_size=inter,
        scoring="sigmoid",
        shared_intermediate_size=inter,
        weighted_inputs=True,
        activation=text.get("hidden_act", "silu"),
    )
    return moe, tuple(i in set(moe_layers) for i in range(num_layers))


def llama4_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Llama 4 text, or the ``text_config`` of a multimodal Llama 4 checkpoint."""
    text = hf.get("text_config") or hf
    num_layers = int(text["num_hidden_layers"])
    rotates = _rope_flags(text, num_layers)
    chunked = _chunked_flags(text, rotates)
    moe, moe_layers = _moe(text)
    eps = float(text.get("rms_norm_eps", 1e-5))
    tuning = bool(text.get("attn_temperature_tuning", True)) and not all(rotates)
    base = llama_like(
        text,
        attention={
            "attention_chunk": int(text["attention_chunk_size"]) if any(chunked) else None,
            "qk_l2_norm": NormConfig("rms", eps) if text.get("use_qk_norm", True) else None,
            "query_temperature": (
                (float(text.get("attn_scale", 0.1)), int(text.get("floor_scale", 8192)))
                if tuning
                else None
            ),
        },
        intermediate_size=int(text.get("intermediate_size_mlp") or text["intermediate_size"]),
        norm=NormConfig("rms", eps),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=moe,
        moe_layers=moe_layers,
        chunked_layers=tuple(chunked) if any(chunked) else (),
        nope_layers=tuple(not r for r in rotates) if not all(rotates) else (),
    )
    rope = dataclasses.replace(base.attention.rope, interleaved=True)
    return dataclasses.replace(base, attention=dataclasses.replace(base.attention, rope=rope))


_GATE_UP = re.compile(LAYER + r"feed_forward\.experts\.gate_up_proj")


def _text_tensors(tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with the multimodal prefix ``language_model.`` dropped and each
    layer's fused expert ``gate_up_proj`` ([experts, hidden, 2 * inter], gate first) cut into
    its gate and up stacks."""
    for name, value in tensors:
        name = name.removeprefix("language_model.")
        if _GATE_UP.fullmatch(name) is None:
            yield name, value
            continue
        if isinstance(value, HostPacked):  # a GGUF file's quantized stacks, [in, out] too
            half = value.codes.shape[-1] // 2
            gate, up = split_out(value, [half, half])
        else:
            gate, up = np.split(np.asarray(value), 2, axis=-1)
        yield name.replace("gate_up_proj", "gate_proj"), gate
        yield name.replace("gate_up_proj", "up_proj"), up


def load(
    cfg: DecoderConfig,
    tensors: Iterable[tuple[str, Any]],
    dtype: Any,
    num_tensors: int | None = None,
    *,
    rules: tuple[WeightRule, ...],
) -> ModelWeights:
    """``models.checkpoint.load`` of the text model's tensors (``_text_tensors``)."""
    return checkpoint.load(cfg, _text_tensors(tensors), dtype, num_tensors, rules=rules)


_FFN = LAYER + r"feed_forward\."
LLAMA4_WEIGHT_RULES = (
    *GLOBAL_RULES,
    *ATTENTION_RULES,
    WeightRule(LAYER + r"post_attention_layernorm\.weight", "mlp_norm", per_layer=True),
    WeightRule(_FFN + r"gate_proj\.weight", "w_gate", transpose=True, per_layer=True),
    WeightRule(_FFN + r"up_proj\.weight", "w_up", transpose=True, per_layer=True),
    WeightRule(_FFN + r"down_proj\.weight", "w_down", transpose=True, per_layer=True),
    WeightRule(_FFN + r"router\.weight", "router", transpose=True, per_layer=True),
    # Expert stacks are stored [experts, in, out] already.
    WeightRule(_FFN + r"experts\.gate_proj", "e_gate", per_layer=True),
    WeightRule(_FFN + r"experts\.up_proj", "e_up", per_layer=True),
    WeightRule(_FFN + r"experts\.down_proj", "e_down", per_layer=True),
    WeightRule(_FFN + r"shared_expert\.gate_proj\.weight", "s_gate", True, True),
    WeightRule(_FFN + r"shared_expert\.up_proj\.weight", "s_up", True, True),
    WeightRule(_FFN + r"shared_expert\.down_proj\.weight", "s_down", True, True),
)
LLAMA4_MULTIMODAL_WEIGHT_RULES = (
    *LLAMA4_WEIGHT_RULES,
    WeightRule(r"(vision_model|multi_modal_projector)\..*", None),
)
