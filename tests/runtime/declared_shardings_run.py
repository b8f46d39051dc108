"""Run in a fresh process with 4 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``): declare tiny models (Llama, DeepSeek, Qwen3-Next, Qwen3.5), place their
zero-filled parameters on a 4-device ``tp`` mesh, and print as one JSON line each array's
declared logical axes and the ``PartitionSpec`` it was placed with, by field; then the same
after one declaration is changed (the final norm's axis renamed ``mlp``), which must move it."""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_llm_runtime.models.decoder import Decoder, DecoderConfig
from jax_llm_runtime.models.layers.attention import AttentionConfig
from jax_llm_runtime.models.layers.expert_offload import ExpertOffload
from jax_llm_runtime.models.layers.linear_attention import LinearAttentionConfig
from jax_llm_runtime.models.layers.mla import MLAConfig
from jax_llm_runtime.models.layers.moe import MoEConfig
from jax_llm_runtime.models.layers.params import params
from jax_llm_runtime.models.layers.rotary import RopeConfig
from jax_llm_runtime.models.state import ModelWeights, nested
from jax_llm_runtime.runtime.parallel.sharding import build_mesh, shard_weights

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3)
BASE["max_position_embeddings"] = 128
MOE = MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=32, shared_intermediate_size=64,
                shared_gate=True, offload=ExpertOffload(per_rank=1, ranks=4))  # fmt: skip
CONFIGS = {
    "llama": DecoderConfig(
        **BASE,
        tie_word_embeddings=False,
        attention=AttentionConfig(8, 4, 16, RopeConfig(10000.0, 16), qkv_bias=True),
    ),
    "deepseek": DecoderConfig(
        **BASE,
        tie_word_embeddings=True,
        attention=MLAConfig(8, 32, 16, 16, 8, 16, RopeConfig(10000.0, 8)),
        moe=MOE,
        first_moe_layer=1,
    ),
}
# Linear attention (Qwen3-Next's fused projections, Qwen3.5's separate ones) in layers 0 and 1.
for name, fused in (("qwen3_next", True), ("qwen3_5", False)):
    CONFIGS[name] = DecoderConfig(
        **BASE,
        tie_word_embeddings=False,
        attention=AttentionConfig(8, 4, 16, RopeConfig(10000.0, 16), output_gate=True),
        linear_attention=LinearAttentionConfig(4, 8, 16, 8, 4, fused_projections=fused),
        linear_layers=(True, True, False),
    )


def zero_filled(cfg: DecoderConfig) -> ModelWeights:
    """Every declared parameter of ``cfg``'s model, zero-filled on the default device; the
    offloaded experts' in pinned host memory."""
    model = Decoder(cfg, jnp.float32)

    def zeros(var: nnx.Variable) -> jax.Array:
        value = var.get_value()
        array = jnp.zeros(value.shape, value.dtype)
        if var.has_metadata("memory_kind"):
            array = jax.device_put(array, jax.memory.Space.Host)
        return array

    return ModelWeights(nnx.graphdef(model), nested((p, zeros(v)) for p, v in params(model)))


def placements(weights: ModelWeights) -> dict[str, Any]:
    """Per field (prefixed by its segment): declared axes, placed spec, memory kind."""
    out = {}
    for path, var in weights.variables():
        name = var.get_metadata("field")
        if path[0] == "segments":
            name = f"{path[1]}.{name}"
        array = var.get_value()
        spec = tuple(array.sharding.spec) + (None,) * (array.ndim - len(array.sharding.spec))
        out[name] = {
            "axes": list(var.get_metadata("out_sharding")),
            "shape": list(array.shape),
            "spec": list(spec),
            "memory_kind": array.sharding.memory_kind,
        }
    return out


def renamed_norm(weights: ModelWeights) -> ModelWeights:
    """``weights`` with the final norm declared along ``mlp`` instead of ``embed``."""
    model = weights.model()
    model.final_norm.weight.set_metadata(out_sharding=("mlp",))
    return ModelWeights.split(model)


if __name__ == "__main__":
    mesh = build_mesh(None, 4)
    result = {}
    for name, cfg in CONFIGS.items():
        for expert_parallel in (False, True):
            placed = shard_weights(zero_filled(cfg), mesh, expert_parallel)
            result[f"{name}/ep={expert_parallel}"] = placements(placed)
    moved = shard_weights(renamed_norm(zero_filled(CONFIGS["llama"])), mesh)
    result["renamed"] = placements(moved)
    print(json.dumps(result))
