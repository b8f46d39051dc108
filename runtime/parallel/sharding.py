"""Tensor parallelism: one SPMD step over a device mesh, the weights and the KV cache split on it.

The mesh has one axis, ``tp``, over the chosen devices. Where each weight goes derives from its
declaration (``models.layers.params``): every parameter names a logical axis per array axis,
and ``LOGICAL_RULES`` below maps the logical axes that split onto ``tp``; every other axis is
whole. XLA's partitioner derives the rest (the activations' layouts and the all-reduces after
the projections whose input is split) from them. What the model's declarations give:

- column-parallel (heads and MLP columns local): the query, key and value projections, the
  MLP's and the shared expert's gate and up projections, and their biases;
- row-parallel (input features split; partial sums all-reduced): the attention output and the
  MLP's (and shared expert's) down projection;
- the vocabulary: the embedding table's rows and the LM head's columns, so the largest matrices
  of a small model are split too;
- the KV cache over its KV-head axis (``models.decoder.KV_CACHE_AXES``), so each device keeps
  the K/V of its own heads; MLA's latent cache (one KV "head" that every head reads) is whole;
- multi-head latent attention by heads: the per-head query projection and ``wkv_b`` by their
  head columns, ``wo`` along its input; the low-rank projections and their norms stay whole, so
  each device attends with its own heads over the whole latent cache;
- Gated DeltaNet (linear attention: Qwen3-Next, Qwen3.5) in blocks of whole key heads with
  their value heads, as vLLM splits it: its input projections column-parallel, the short
  convolution's channels, the per-head decay parameters and the state slots (the convolution's
  last inputs and the recurrent state, ``HybridCache``) along their heads, the output
  projection row-parallel; the layer runs on each device's heads with no communication before
  the all-reduce after its output projection. Its key heads must divide by the mesh size
  (``check_linear_divisible``);
- with expert parallelism, the routed experts' stacks over their expert axis, so each device
  keeps its share of the experts whole. Offloaded experts' stacks split the same way and stay in
  the pinned host memory of their devices (``models.layers.expert_offload``).

Quantized values split along the same logical axes: every array of a ``PackedWeight`` (codes
and group scales together; an axis of size 1, a per-matrix zero, stays whole), an int8 weight's
per-column scales (which lack the input axis) with its columns. An axis that does not divide by
the mesh size stays whole (a vocabulary of 32001: the step stays correct). Attention heads,
outside MLA the KV heads, and linear-attention key heads must divide by the tensor-parallel
size (a clear error at startup), so that every device holds whole heads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_llm_runtime.models.decoder import KV_CACHE_AXES
from jax_llm_runtime.models.layers.linear_attention import (
    CONV_STATE_AXES,
    RECURRENT_STATE_AXES,
    HybridCache,
    LinearAttentionConfig,
)
from jax_llm_runtime.models.layers.params import (
    EXPERTS,
    FFN,
    HEADS,
    KV_HEADS,
    LINEAR_HEADS,
    VOCAB,
)
from jax_llm_runtime.models.state import ModelWeights, nested

AXIS = "tp"
# Logical axis -> mesh axis; every logical axis not named stays whole.
LOGICAL_RULES = {VOCAB: AXIS, HEADS: AXIS, KV_HEADS: AXIS, FFN: AXIS, LINEAR_HEADS: AXIS}


def logical_rules(expert_parallel: bool) -> dict[str, str]:
    """``LOGICAL_RULES``, with the routed experts split too under expert parallelism."""
    return LOGICAL_RULES | ({EXPERTS: AXIS} if expert_parallel else {})


class ShardingError(ValueError):
    """A mesh that cannot be built, or a model that does not split over it."""


def build_mesh(devices: Sequence[int] | None, tensor_parallel_size: int) -> Mesh | None:
    """The ``tp`` mesh over ``devices`` (indices into ``jax.devices()``; default the first
    ``tensor_parallel_size``), or None for one device (nothing is sharded)."""
    available = jax.devices()
    if devices is None:
        devices = list(range(tensor_parallel_size))
    if len(devices) != tensor_parallel_size:
        raise ShardingError(
            f"--devices lists {len(devices)} devices but --tensor-parallel-size is "
            f"{tensor_parallel_size}"
        )
    if len(set(devices)) != len(devices):
        raise ShardingError(f"--devices repeats a device: {list(devices)}")
    missing = [d for d in devices if not 0 <= d < len(available)]
    if missing:
        raise ShardingError(
            f"device {missing[0]} does not exist: {len(available)} {available[0].platform} "
            f"device(s) are visible (0 to {len(available) - 1})"
        )
    chosen = [available[d] for d in devices]
    processes = jax.process_count()
    if processes > 1 and len({d.process_index for d in chosen}) < processes:
        raise ShardingError(
            f"the mesh must use devices of all {processes} processes: "
            f"--tensor-parallel-size {tensor_parallel_size} over devices {list(devices)} "
            f"leaves some out ({len(available)} devices in all, "
            f"{jax.local_device_count()} per process)"
        )
    if tensor_parallel_size == 1 and devices == [0]:
        return None
    return Mesh(np.array(chosen), (AXIS,))


def check_divisible(num_heads: int, num_kv_heads: int, size: int, is_mla: bool) -> None:
    """Refuse a model whose heads do not split evenly over ``size`` devices: the attention
    heads must divide by ``size``, and the KV heads divide by it or divide it (then each is
    repeated on ``size // num_kv_heads`` devices: ``runtime.parallel.kv_heads``). MLA's one
    latent KV "head" is replicated, so only its attention heads must divide."""
    if size == 1:
        return
    if num_heads % size:
        raise ShardingError(
            f"the model's {num_heads} attention heads do not divide by --tensor-parallel-size {size}"
        )
    if not is_mla and num_kv_heads % size and size % num_kv_heads:
        raise ShardingError(
            f"the model's {num_kv_heads} KV heads do not divide by --tensor-parallel-size {size} "
            f"(nor divide it, which would repeat each on {size} // {num_kv_heads} devices)"
        )


def check_linear_divisible(cfg: LinearAttentionConfig | None, size: int) -> None:
    """Refuse linear-attention layers whose key heads do not divide by ``size`` devices: each
    device must hold whole key heads with their value heads, since a layer's channels are laid
    out head by head (``models.layers.linear_attention``) and a block of channels that is not
    whole heads would need other devices' channels in the layer."""
    if cfg is not None and cfg.num_k_heads % size:
        raise ShardingError(
            f"the model's {cfg.num_k_heads} linear-attention key heads (linear_num_key_heads) "
            f"do not divide by --tensor-parallel-size {size}"
        )


def partition_spec(
    axes: Sequence[str | None], shape: Sequence[int], rules: Mapping[str, str], size: int
) -> PartitionSpec:
    """The mesh split of an array of ``shape`` declared along logical ``axes``: each axis whose
    logical name ``rules`` map, divides by the mesh ``size`` and is longer than 1 (a packed
    weight's per-matrix zero), once per mesh axis. An array one axis short of its declaration
    lacks the input axis (an int8 weight's per-column scales); one longer ends in axes of its
    own (none are split)."""
    axes = tuple(axes)
    if len(shape) == len(axes) - 1 and len(axes) >= 2:
        axes = (*axes[:-2], axes[-1])
    parts: list[str | None] = []
    for name, n in zip(axes, shape, strict=False):
        mesh_axis = rules.get(name) if name is not None else None
        ok = mesh_axis is not None and mesh_axis not in parts and n > 1 and n % size == 0
        parts.append(mesh_axis if ok else None)
    return PartitionSpec(*parts)


def _declared_axes(var: nnx.Variable) -> tuple[str | None, ...]:
    axes = var.get_metadata("out_sharding", None)
    if axes is None:
        raise ShardingError(f"parameter {var.get_metadata('field', '?')!r} declares no axes")
    return tuple(axes)


def weight_shardings(weights: ModelWeights, mesh: Mesh, expert_parallel: bool = False) -> Any:
    """The ``NamedSharding`` of every array of ``weights.state`` (a pytree like it), from the
    parameters' declared logical axes; arrays in host memory (offloaded experts) keep it."""
    rules = logical_rules(expert_parallel)

    def of(var: nnx.Variable) -> Any:
        axes = _declared_axes(var)

        def leaf(a: Any) -> NamedSharding:
            memory_kind = getattr(getattr(a, "sharding", None), "memory_kind", None)
            spec = partition_spec(axes, a.shape, rules, mesh.size)
            return NamedSharding(mesh, spec, memory_kind=memory_kind)

        return jax.tree.map(leaf, var.get_value())

    return nested((path, of(var)) for path, var in weights.variables())


def shard_weights(weights: ModelWeights, mesh: Mesh, expert_parallel: bool = False) -> ModelWeights:
    """The weights placed on ``mesh`` by their declared logical axes (the module docstring)."""
    shardings = weight_shardings(weights, mesh, expert_parallel)
    return weights.replace(state=jax.device_put(weights.state, shardings))


def cache_sharding(cache: Any, mesh: Mesh) -> Any:
    """Shardings of a ``KVCache`` pytree by ``KV_CACHE_AXES``: K, V and their row scales split
    over KV heads (MLA's latent cache, one KV "head", stays whole); of a ``HybridCache``, its
    KV cache so and its state slots over their linear-attention heads."""

    def sharding(axes: Sequence[str | None], a: Any) -> NamedSharding:
        return NamedSharding(mesh, partition_spec(axes, a.shape, LOGICAL_RULES, mesh.size))

    if isinstance(cache, HybridCache):
        return HybridCache(
            cache_sharding(cache.kv, mesh),
            sharding(CONV_STATE_AXES, cache.conv),
            sharding(RECURRENT_STATE_AXES, cache.recurrent),
        )
    return jax.tree.map(lambda a: sharding(KV_CACHE_AXES[: a.ndim], a), cache)


def replicated_sharding(tree: Any) -> NamedSharding | None:
    """A sharding that replicates a value over the mesh of ``tree``'s shardings (None when
    they are not on a mesh): what every process of a multi-node run can read whole."""
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding)):
        sharding = leaf if isinstance(leaf, NamedSharding) else getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
    return None


def placed(tree: Any) -> Any:
    """Abstract values of device arrays, with their shardings (a mesh's steps compile for them)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def host_inputs(tree: Any, sharding: NamedSharding | None) -> Any:
    """Abstract values of a step's host inputs (token batch, sampling metadata) with the one
    sharding they are compiled for and called with: ``sharding`` is the mesh's replicated one
    (every process holds the whole batch) or None off a mesh. Left unspecified, the partitioner
    may choose a split (the grammar mask follows the vocabulary-split logits), and an input kept
    on the device with another sharding would then be refused by the compiled step."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def device_bytes(tree: Any, memory_kind: str = "device") -> dict[Any, int]:
    """Bytes each device holds of a pytree of arrays in its ``memory_kind`` memory: its own
    (``"device"``) or the host memory it is attached to (``"pinned_host"``)."""
    total: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        if leaf.sharding.memory_kind != memory_kind:
            continue
        for shard in leaf.addressable_shards:
            total[shard.device] = total.get(shard.device, 0) + shard.data.nbytes
    return total
