"""GGUF metadata to an HF ``config.json`` dict: the generic pass and each architecture's own steps.

llama.cpp's converter writes ``<arch>.*`` keys from the HF config, leaves out what llama.cpp
hard-codes (Gemma's sliding-window pattern, Qwen3-MoE's renormalized routing) and moves some
settings into tensors (Llama 3 rope factors, Phi-3 longrope factors). ``build_config`` maps keys
through the architecture's table (``gguf_archs``); the ``finish_*`` steps put back what the
converter left out, with the values llama.cpp itself assumes when it runs the file (those of
the architectures in ``archs_recent`` are in ``config_recent``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from jax_llm_runtime.runtime.loading.gguf.reader import GGUFError, short_repr

if TYPE_CHECKING:
    from jax_llm_runtime.runtime.loading.gguf.spec import ArchSpec

# Small tensors that are configuration, not weights: read at header time, never yielded.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# Sizes the loader computes with, checked in this order (head_dim defaults from the first ones);
# other values pass through to the HF config as written.
_POSITIVE_INTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)
_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
# llama.cpp picks Gemma's 27B attention scale by layer count (query_pre_attn_scalar is not stored).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True)
class GGUFModel:
    """What the config translation may look at: the file's metadata, every tensor's shape, and the
    values of the ``CONFIG_TENSORS`` present."""

    arch: str
    metadata: Mapping[str, Any]
    shapes: Mapping[str, tuple[int, ...]]  # GGUF tensor name -> numpy shape
    values: Mapping[str, np.ndarray]  # CONFIG_TENSORS name -> [n] float32

    def get(self, key: str, default: Any = None) -> Any:
        """The plain Python value of ``<arch>.<key>``, or ``default``."""
        value = self.metadata.get(f"{self.arch}.{key}")
        return default if value is None else plain(value)

    def get_int(self, key: str, default: int | None = None) -> int | None:
        """Like ``get``, for a count or size the translation computes with."""
        value = self.get(key, default)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise GGUFError(
                f"GGUF metadata {self.arch}.{key} must be a non-negative integer, "
                f"got {short_repr(value)}"
            )
        return value

    def get_float(self, key: str, default: float | None = None) -> float | None:
        """Like ``get``, for a number the translation computes with."""
        value = self.get(key, default)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise GGUFError(
                f"GGUF metadata {self.arch}.{key} must be a number, got {short_repr(value)}"
            )
        return value

    @cached_property
    def layer_tensors(self) -> frozenset[str]:
        """Tensor names after ``blk.N.``, over all layers."""
        return frozenset(n.split(".", 2)[2] for n in self.shapes if n.startswith("blk."))


def plain(value: Any) -> Any:
    """Metadata as JSON-able Python. Floats that are exactly float32 get their shortest float32
    spelling: the converter stored 1e-6 as float32, and HF configs compare against 1e-6."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and math.isfinite(value) and float(np.float32(value)) == value:
        return float(str(np.float32(value)))
    return value


def build_config(spec: ArchSpec, model: GGUFModel) -> dict[str, Any]:
    """The HF config dict of a GGUF model. Raises GGUFError for missing or inconsistent keys."""
    missing = [f"{model.arch}.{key}" for key in spec.required if model.get(key) is None]
    if missing:
        raise GGUFError(f"GGUF metadata is missing required key(s): {', '.join(missing)}")
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        **spec.defaults,
    }
    for key, hf_key in spec.metadata.items():
        if (value := model.get(key)) is not None:
            config[hf_key] = _one_value(f"{model.arch}.{key}", value)
    # No padding id in the file means none, not the HF class default (which may not even fit
    # the vocabulary).
    config["pad_token_id"] = None
    config.update(
        {hf: model.metadata[k] for k, hf in _TOKEN_ID_KEYS.items() if k in model.metadata}
    )
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    _check_config(config)
    config["vocab_size"] = _vocab_size(model)
    config["tie_word_embeddings"] = "output.weight" not in model.shapes
    if scaling := _rope_scaling(model):
        config["rope_scaling"] = scaling
    if "rope_freqs.weight" in model.values:
        # Llama 3 files carry the per-frequency divisors instead of rope_scaling; a non-HF key.
        config["rope_freq_factors"] = plain(model.values["rope_freqs.weight"])
    spec.finish(config, model)
    return config


def _one_value(key: str, value: Any) -> Any:
    # Some converters write per-layer arrays; HF configs hold one value per key.
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise GGUFError(
                f"GGUF metadata {key} differs between layers ({short_repr(value)}); "
                "this is not supported"
            )
        value = value[0]
    # A size of inf or NaN would overflow (or poison) whatever computes with it.
    if isinstance(value, float) and not math.isfinite(value):
        raise GGUFError(f"GGUF metadata {key} must be finite, got {value}")
    return value


def _check_config(config: dict[str, Any]) -> None:
    """Check the sizes the loader computes with, filling in head_dim."""
    for key in _POSITIVE_INTS:
        if key == "head_dim":
            config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
        value = config.get(key)
        if key in config and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise GGUFError(
                f"GGUF metadata: {key} must be a positive integer, got {short_repr(value)}"
            )
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise GGUFError(
            f"GGUF metadata: {config['num_attention_heads']} attention heads are not a multiple "
            f"of {config['num_key_value_heads']} key/value heads"
        )


def _vocab_size(model: GGUFModel) -> int:
    # The embedding rows are what the weights need; Gemma 3's converter trims them to the
    # tokenizer, others pad, and <arch>.vocab_size is not always written.
    if "token_embd.weight" in model.shapes:
        return model.shapes["token_embd.weight"][0]
    if (size := model.get("vocab_size")) is not None:
        return size
    return len(model.metadata.get("tokenizer.ggml.tokens", ()))


def _rope_scaling(model: GGUFModel) -> dict[str, Any] | None:
    kind = model.get("rope.scaling.type", "none")
    if kind == "none" and "rope_factors_long.weight" in model.values:
        kind = "longrope"  # Phi-3 files record longrope only through its factor tensors
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": model.get_float("rope.scaling.factor", 1.0)}
    if kind == "longrope":
        return _longrope(model)
    if kind != "yarn":
        raise GGUFError(
            f"{model.arch}.rope.scaling.type {short_repr(kind)} is not supported (linear, yarn, "
            "longrope)"
        )
    original = model.get_int("rope.scaling.original_context_length")
    if original is None:
        raise GGUFError(
            f"GGUF metadata is missing required key {model.arch}.rope.scaling."
            "original_context_length for yarn rope scaling"
        )
    scaling = {
        "rope_type": "yarn",
        "factor": model.get_float("rope.scaling.factor", 1.0),
        "original_max_position_embeddings": original,
    }
    for key, hf_key in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        if (value := model.get_float(f"rope.scaling.{key}")) is not None:
            scaling[hf_key] = value
    return scaling


def _longrope(model: GGUFModel) -> dict[str, Any]:
    factors = {k: model.values.get(f"rope_factors_{k}.weight") for k in ("long", "short")}
    if any(v is None for v in factors.values()):
        raise GGUFError(
            "longrope scaling needs both rope_factors_long.weight and rope_factors_short.weight"
        )
    return {
        "rope_type": "longrope",
        "long_factor": plain(factors["long"]),
        "short_factor": plain(factors["short"]),
    }


def has_qkv_bias(model: GGUFModel) -> bool:
    """Whether the file's attention has q/k/v biases (separate or fused)."""
    return bool({"attn_q.bias", "attn_qkv.bias"} & model.layer_tensors)


def rotary_fraction(config: dict[str, Any], model: GGUFModel) -> float:
    """The rotated fraction of each head (``rope.dimension_count`` over ``head_dim``)."""
    # The converter stores the rotated width; llama.cpp rotates the whole head when it is absent.
    return model.get_int("rope.dimension_count", config["head_dim"]) / config["head_dim"]


def finish_nothing(config: dict[str, Any], model: GGUFModel) -> None:
    """For architectures whose table says everything."""


def finish_llama(config: dict[str, Any], model: GGUFModel) -> None:
    """Llama, or Mixtral when the file has experts (llama.cpp has no separate architecture)."""
    if config.get("num_local_experts"):
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
        return
    config.pop("num_local_experts", None)
    config.pop("num_experts_per_tok", None)
    config.pop("moe_intermediate_size", None)
    config["attention_bias"] = has_qkv_bias(model)
    config["mlp_bias"] = "ffn_gate.bias" in model.layer_tensors


def finish_qwen3(config: dict[str, Any], model: GGUFModel) -> None:
    """Qwen3 and Qwen3-MoE: biases are optional in HF and absent in the released models."""
    config["attention_bias"] = has_qkv_bias(model)


def finish_phi3(config: dict[str, Any], model: GGUFModel) -> None:
    """Phi-3: partial rotary (Phi-4-mini), and sliding window 0 meaning none."""
    config["partial_rotary_factor"] = rotary_fraction(config, model)
    if not config.get("sliding_window"):
        config["sliding_window"] = None


def finish_gemma2(config: dict[str, Any], model: GGUFModel) -> None:
    """Gemma 2: local attention on even layers unless the file says otherwise."""
    _finish_gemma(config, model, default_period=2)


def finish_gemma3(config: dict[str, Any], model: GGUFModel) -> None:
    """Gemma 3: five local layers per global one; without a sliding window every layer is global."""
    if config.get("sliding_window"):
        _finish_gemma(config, model, default_period=6)
    else:
        _finish_gemma(config, model, default_period=None)
        config["sliding_window"] = None


def _finish_gemma(config: dict[str, Any], model: GGUFModel, default_period: int | None) -> None:
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    big = layers == _GEMMA_27B_LAYERS[model.arch]
    config["query_pre_attn_scalar"] = config["hidden_size"] // heads if big else config["head_dim"]
    config["layer_types"] = [
        "sliding_attention" if sliding else "full_attention"
        for sliding in sliding_layers(model, layers, default_period)
    ]


def sliding_layers(model: GGUFModel, layers: int, period: int | None) -> list[bool]:
    """Which layers use the sliding window: the file's per-layer flags or period, else
    ``period`` (None: none)."""
    if period is None:
        return [False] * layers
    key = "attention.sliding_window_pattern"
    pattern = model.get(key)
    if isinstance(pattern, list):  # one flag per layer
        if len(pattern) != layers:
            raise GGUFError(
                f"{model.arch}.{key} has {len(pattern)} entries for {layers} layers; "
                "the file is inconsistent"
            )
        return [bool(p) for p in pattern]
    period = model.get_int(key, period)
    # llama.cpp: within each period the last layer is global; period 0 means all local.
    return [period == 0 or i % period < period - 1 for i in range(layers)]


def finish_stablelm(config: dict[str, Any], model: GGUFModel) -> None:
    """StableLM: partial rotary; biases, per-head q/k norms and the parallel residual are read off
    the tensors, as llama.cpp does (a parallel-residual layer has no ffn_norm)."""
    config["partial_rotary_factor"] = rotary_fraction(config, model)
    config["use_qkv_bias"] = has_qkv_bias(model)
    config["qk_layernorm"] = "attn_q_norm.weight" in model.layer_tensors
    config["use_parallel_residual"] = "ffn_norm.weight" not in model.layer_tensors


def finish_glm4(config: dict[str, Any], model: GGUFModel) -> None:
    """GLM-4: partial rotary (half the head) and optional q/k/v biases."""
    config["partial_rotary_factor"] = rotary_fraction(config, model)
    config["attention_bias"] = has_qkv_bias(model)


def finish_deepseek2(config: dict[str, Any], model: GGUFModel) -> None:
    """DeepSeek V2/V3 multi-head latent attention and routing.

    The converter records MLA as one KV head of width kv_lora_rank + rope dims (the "absorbed"
    view); the per-head sizes are the ``*_mla`` lengths (older files: the plain lengths). V3 is
    told apart by sigmoid gating or its routing bias tensor (exp_probs_b).
    """
    rope_dim = model.get_int("rope.dimension_count")
    qk_dim = model.get_int("attention.key_length_mla", model.get_int("attention.key_length"))
    v_dim = model.get_int("attention.value_length_mla", model.get_int("attention.value_length"))
    if qk_dim is None or v_dim is None or qk_dim <= rope_dim:
        raise GGUFError(
            f"GGUF metadata: {model.arch}.attention.key_length_mla/value_length_mla are missing "
            f"or not larger than the rope width {rope_dim}"
        )
    config.update(
        num_key_value_heads=config["num_attention_heads"],
        head_dim=rope_dim,  # HF's DeepSeek configs set head_dim to the rope width
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=qk_dim - rope_dim,
        v_head_dim=v_dim,
    )
    if "n_routed_experts" not in config:  # a dense model: every layer is a plain MLP
        config["first_k_dense_replace"] = config["num_hidden_layers"]
    sigmoid = model.get("expert_gating_func") == _GATING_SIGMOID
    if sigmoid or "exp_probs_b.bias" in model.layer_tensors:
        config.setdefault("n_group", 1)
        config.setdefault("topk_group", 1)
        config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    else:
        grouped = (model.get_int("expert_group_count") or 1) > 1
        config.update(
            architectures=["DeepseekV2ForCausalLM"],
            model_type="deepseek_v2",
            topk_method="group_limited_greedy" if grouped else "greedy",
            scoring_func="softmax",
        )
    log_mul = model.get_float("rope.scaling.yarn_log_multiplier")
    if log_mul is not None and "rope_scaling" in config:
        # The converter stores 0.1 * mscale_all_dim; llama.cpp (like the released configs) takes
        # mscale equal to it, which makes HF's yarn attention factor 1.
        mscale = float(f"{log_mul / 0.1:.6g}")
        config["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)


def finish_glm4_moe(config: dict[str, Any], model: GGUFModel) -> None:
    """GLM-4.5 MoE: partial rotary, optional q/k/v biases and q/k norms (read off the tensors);
    the converter counts its next-token-prediction layers in block_count, so they are taken
    back out (their tensors are skipped: ``tensors.plan_tensors``)."""
    _check_sigmoid_gating(model)
    config["partial_rotary_factor"] = rotary_fraction(config, model)
    config["attention_bias"] = has_qkv_bias(model)
    config["use_qk_norm"] = "attn_q_norm.weight" in model.layer_tensors
    nextn = config.get("num_nextn_predict_layers", 0)
    if not 0 <= nextn < config["num_hidden_layers"]:
        raise GGUFError(
            f"GGUF metadata: {model.arch}.nextn_predict_layers is {nextn} of "
            f"{config['num_hidden_layers']} blocks"
        )
    config["num_hidden_layers"] -= nextn


def finish_minimax_m2(config: dict[str, Any], model: GGUFModel) -> None:
    """MiniMax-M2: the rotated width is ``rotary_dim`` in HF terms; routing is always sigmoid
    with a correction bias."""
    _check_sigmoid_gating(model)
    config["rotary_dim"] = model.get_int("rope.dimension_count", config["head_dim"])


def _check_sigmoid_gating(model: GGUFModel) -> None:
    func = model.get("expert_gating_func")
    if func is not None and func != _GATING_SIGMOID:
        raise GGUFError(
            f"GGUF metadata: {model.arch}.expert_gating_func is {func}; this architecture "
            f"routes with sigmoid scores ({_GATING_SIGMOID}) only"
        )
