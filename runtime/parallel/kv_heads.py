"""Tensor parallelism over more devices than a model has KV heads: each KV head is repeated so
that every device holds the KV head its query heads read, as vLLM does (Llama-3-70B's 8 KV heads
on 16 devices: each head on 2; a 2-KV-head model on 4).

Grouped-query attention reads KV head ``h // (num_heads // num_kv_heads)`` for query head ``h``.
Repeating each KV head ``times`` times in place (head ``j`` becomes heads ``j * times`` to
``j * times + times - 1``) keeps that rule true with ``num_kv_heads * times`` KV heads, so the
model runs unchanged on the repeated weights: their key and value projections (kernels, biases,
per-head key norms, packed codes and group scales alike) repeat their output columns in blocks
of one head, and the KV cache, declared from the new head count, splits one head per device.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_llm_runtime.models.layers.params import KV_HEADS
from jax_llm_runtime.models.state import ModelWeights, nested
from jax_llm_runtime.runtime.parallel.sharding import check_divisible

logger = logging.getLogger(__name__)


def kv_replicas(num_heads: int, num_kv_heads: int, size: int, is_mla: bool) -> int:
    """Copies of each KV head that ``size`` devices need: 1 where the KV heads divide by
    ``size`` (and for MLA, whose one latent "head" is replicated anyway), else ``size //
    num_kv_heads``. Raises ``ShardingError`` (``check_divisible``) for heads that split neither
    way."""
    check_divisible(num_heads, num_kv_heads, size, is_mla)
    if size == 1 or is_mla or num_kv_heads % size == 0:
        return 1
    return size // num_kv_heads


def replicate_kv_heads(model_config: Any, weights: ModelWeights, times: int) -> tuple[Any, Any]:
    """``model_config`` with ``times`` as many KV heads, and ``weights`` with each KV head's
    parameters repeated ``times`` times in place (see the module docstring)."""
    attention = model_config.attention
    kv, head_dim = attention.num_kv_heads, attention.head_dim
    config = dataclasses.replace(
        model_config, attention=dataclasses.replace(attention, num_kv_heads=kv * times)
    )

    def repeat(var: nnx.Variable) -> Any:
        axes = tuple(var.get_metadata("out_sharding", None) or ())
        if KV_HEADS not in axes:
            return var.get_value()
        # From the end: the output axis of a projection (kernel, bias, packed arrays, all
        # [..., kv * head_dim]) or the heads axis of a per-head norm ([..., kv, head_dim]).
        back = len(axes) - axes.index(KV_HEADS)
        width = kv * head_dim if back == 1 else kv
        return jax.tree.map(lambda a: _repeat_blocks(a, back, width, kv, times), var.get_value())

    state = nested((path, repeat(var)) for path, var in weights.variables())
    graphdef = nnx.graphdef(weights.model().redeclared(config))
    logger.info(
        "each of the model's %d KV heads is repeated on %d devices (tensor parallelism wider "
        "than the KV heads)",
        kv,
        times,
    )
    return config, ModelWeights(graphdef, state)


def _repeat_blocks(a: Any, back: int, width: int, blocks: int, times: int) -> Any:
    """``a`` with its axis ``-back`` (of length ``width``, ``blocks`` equal blocks) repeated
    block by block ``times`` times; any other array (a matrix-wide zero code) as it is."""
    if a.ndim < back or a.shape[-back] != width:
        return a
    axis = a.ndim - back
    split = (*a.shape[:axis], blocks, width // blocks, *a.shape[axis + 1 :])
    out = jnp.repeat(jnp.reshape(a, split), times, axis=axis)
    return jnp.reshape(out, (*a.shape[:axis], width * times, *a.shape[axis + 1 :]))
