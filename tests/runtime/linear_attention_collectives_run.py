"""Run in a fresh process with 4 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``): place one Gated DeltaNet layer
(Qwen3-Next's fused projections, then Qwen3.5's separate ones) and a ``HybridCache`` on a 4-device
``tp`` mesh, compile the layer over a prompt chunk and over a decode step of two sequences, and
print as one JSON line the collectives each compiled step holds, by kind."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.layers.linear_attention import (
    GatedDeltaNet,
    HybridCache,
    LinearAttentionConfig,
    paged_linear_attention,
)
from jax_llm_runtime.models.layers.params import params
from jax_llm_runtime.models.state import ModelWeights, nested
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache
from jax_llm_runtime.runtime.parallel.sharding import build_mesh, cache_sharding, shard_weights

HIDDEN = 64
# An op (not a value named after one): its kind, maybe its async start, then its operands.
COLLECTIVE = re.compile(
    r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)


def collectives(fused: bool, q_lens: list[int]) -> dict[str, int]:
    """Collectives of one layer's step over sequences of ``q_lens`` new tokens (slots 0, 1)."""
    mesh = build_mesh(None, 4)
    cfg = LinearAttentionConfig(4, 8, 16, 8, 4, fused_projections=fused)
    layer = GatedDeltaNet(cfg, (), HIDDEN, jnp.float32)
    rng = np.random.default_rng(0)
    state = nested(
        (path, jnp.asarray(rng.standard_normal(var.get_value().shape), jnp.float32))
        for path, var in params(layer)
    )
    weights = shard_weights(ModelWeights(nnx.graphdef(layer), state), mesh)
    kv_shape = (1, 8, 4, 4, 16)
    cache = HybridCache.zeros(
        KVCache.zeros(kv_shape, jnp.float32, kv_shape), cfg, 2, 4, jnp.float32
    )
    shardings = cache_sharding(jax.eval_shape(lambda: cache), mesh)
    cache = jax.device_put(cache, shardings)
    width = max(q_lens)
    zeros = np.zeros((2, width), np.int32)
    lens = np.asarray(q_lens, np.int32)
    batch = StepBatch.padded(zeros, zeros, lens, lens, np.zeros((2, 2), np.int32))
    x = jnp.ones((batch.tokens.shape[0], HIDDEN))

    def step(state, x, cache, batch):
        layer = nnx.merge(weights.graphdef, state)
        out, cache = paged_linear_attention(layer, x, cache, jnp.int32(1), batch)
        return out, jax.lax.with_sharding_constraint(cache, shardings)

    text = jax.jit(step).lower(weights.state, x, cache, batch).compile().as_text()
    found = COLLECTIVE.findall(text)
    return {kind: found.count(kind) for kind in sorted(set(found))}


if __name__ == "__main__":
    result = {
        f"{'fused' if fused else 'split'}/{kind}": collectives(fused, q_lens)
        for fused in (True, False)
        for kind, q_lens in (("chunk", [5, 0]), ("decode", [1, 1]))
    }
    print(json.dumps(result))
