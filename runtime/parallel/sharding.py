"""Tensor parallelism: one SPMD step over a device mesh, the weights and the KV cache split on it.

The mesh has one axis, ``tp``, over the chosen devices. The rules below say which axis of each
weight field is split; everything else is replicated. XLA's partitioner derives the rest (the
activations' layouts and the all-reduces after the row-parallel projections) from them:

- column-parallel (output features split, so heads and MLP columns are local): ``wq``, ``wk``,
  ``wv``, ``w_gate``, ``w_up`` (and the shared experts' ``s_gate``, ``s_up``) and their biases;
- row-parallel (input features split; the partial sums are all-reduced): ``wo``, ``w_down``,
  ``s_down``;
- the vocabulary: ``embed`` (rows) and ``lm_head`` (columns), so the largest matrices of a small
  model are split too;
- the KV cache over its KV-head axis, so each device keeps the K/V of its own heads;
- multi-head latent attention (DeepSeek, ``models.layers.mla``) by heads as well: the per-head
  query projection (``wq``, or ``wq_b`` after the low-rank ``wq_a``; each head's nope and rope
  columns lie together) and the up-projection ``wkv_b`` (each head's W_UK and W_UV columns)
  column-parallel, ``wo`` row-parallel. The low-rank ``wq_a`` and ``wkv_a``, their norms and
  biases, and the latent KV cache (one row that every head reads: its KV-head axis has size 1)
  are replicated, so each device attends with its own heads over the whole latent cache, in the
  absorbed form of decode as in the expanded form without the cache;
- with expert parallelism, the routed experts' stacks (``e_gate``, ``e_up``, ``e_down``) over
  their expert axis, so each device keeps its share of the experts whole (the router and the
  shared expert follow the rules above). Offloaded experts' stacks split the same way and stay
  in the pinned host memory of their devices (``models.layers.expert_offload``).

Packed and int8 weights split the same way: every array of a ``PackedWeight`` along the same
logical axis (codes and group scales together), an int8 weight's per-column scales with its
columns. Attention heads, and outside MLA the KV heads, must divide by the tensor-parallel size
(a clear error at startup), so that every device holds whole heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "tp"
_COLUMN = frozenset(
    ("wq", "wk", "wv", "w_gate", "w_up", "s_gate", "s_up", "bq", "bk", "bv", "b_up")
).union(("wq_b", "wkv_b"))  # MLA's per-head projections
_ROW = frozenset(("wo", "w_down", "s_down"))
# [layers, experts, in, out] in a segment; ``*_host``: the experts offloaded to host memory
_EXPERTS = frozenset(("e_gate", "e_up", "e_down", "e_gate_host", "e_up_host", "e_down_host"))


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
    """Refuse a model whose heads do not split evenly over ``size`` devices. MLA's one latent
    KV "head" is replicated, so only its attention heads must divide."""
    if size == 1:
        return
    counts = [("attention heads", num_heads)]
    if not is_mla:
        counts.append(("KV heads", num_kv_heads))
    for name, count in counts:
        if count % size:
            raise ShardingError(
                f"the model's {count} {name} do not divide by --tensor-parallel-size {size}"
            )


def _spec(ndim: int, axis: int | None) -> PartitionSpec:
    if axis is None:
        return PartitionSpec()
    parts: list[str | None] = [None] * ndim
    parts[axis % ndim] = AXIS
    return PartitionSpec(*parts)


def _field_and_role(path: tuple[Any, ...]) -> tuple[str | None, str | None]:
    """The weight field a leaf belongs to, and its role inside a quantized weight (``scale`` of
    an int8 weight, ``z`` of a packed one)."""
    field = role = None
    for key in path:
        if isinstance(key, jax.tree_util.DictKey) and isinstance(key.key, str):
            field = key.key
        elif isinstance(key, jax.tree_util.GetAttrKey):
            role = key.name
    return field, role


def _weight_axis(path: tuple[Any, ...], leaf: Any, expert_parallel: bool) -> int | None:
    field, role = _field_and_role(path)
    ndim = getattr(leaf, "ndim", 0)
    if field in _EXPERTS:
        return 1 if expert_parallel else None
    if field == "embed":
        return 0
    if field == "lm_head":
        return ndim - 1
    if field in _COLUMN:
        return None if leaf.shape[-1] == 1 else ndim - 1
    if field in _ROW:
        if role == "scale" or ndim < 2 or leaf.shape[-2] == 1:
            return None  # an int8 weight's column scales; a packed weight's constant zero
        return ndim - 2
    return None


def shard_weights(weights: Any, mesh: Mesh, expert_parallel: bool = False) -> Any:
    """The weight pytree placed on ``mesh`` by the rules of the module docstring."""

    def place(path: tuple[Any, ...], leaf: Any) -> Any:
        axis = _weight_axis(path, leaf, expert_parallel)
        if axis is not None and leaf.shape[axis] % mesh.size:
            axis = None  # e.g. a vocabulary of 32001: kept whole (the step stays correct)
        # A leaf in host memory (offloaded experts) stays there, never passing the device's.
        memory_kind = getattr(leaf.sharding, "memory_kind", None)
        return jax.device_put(leaf, NamedSharding(mesh, _spec(leaf.ndim, axis), memory_kind))

    return jax.tree_util.tree_map_with_path(place, weights)


def cache_sharding(cache: Any, mesh: Mesh) -> Any:
    """Shardings of a ``KVCache`` pytree: K, V and their row scales split over KV heads (axis
    3). MLA's latent cache has one KV "head" that every query head reads: it is replicated."""

    def sharding(a: Any) -> NamedSharding:
        return NamedSharding(mesh, _spec(a.ndim, 3 if a.shape[3] > 1 else None))

    return jax.tree.map(sharding, cache)


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
