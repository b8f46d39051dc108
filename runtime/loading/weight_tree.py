"""The weight pytree as data: its structure as JSON, its arrays as a plain nested dict.

A prepared checkpoint (``runtime.loading.prepared``) keeps the arrays in orbax-checkpoint and
this description of the tree beside them, so restoring needs neither the original checkpoint
nor the loader. ``describe`` turns a weight pytree into a JSON-able *skeleton* and the plain
tree of its arrays (string-keyed dicts only, which every orbax version stores the same way);
``abstract_arrays`` gives the orbax restore target of a skeleton (shapes, dtypes, shardings)
and ``assemble`` rebuilds the pytree from a skeleton and its arrays. Node kinds:

- ``dict`` (string keys, or int keys: the indices of a module list, stored as strings),
  ``tuple`` and ``list`` (their items keyed "0", "1", ... among the arrays), and ``none``;
- ``model``: a split model (``models.state.ModelWeights``): its state, and what declared its
  graph definition (``declared``, JSON), which ``assemble`` turns back into one through its
  ``graphdef_for``;
- ``array``: shape, dtype, the ``PartitionSpec`` it was placed with (null off a mesh) and its
  memory kind (``pinned_host`` for offloaded experts);
- ``node``: a pytree dataclass of ``NODE_TYPES`` (the packed and int8 weights) by class name,
  its data fields as children and its static fields as JSON values.

Anything else is refused when a checkpoint is written (``WeightTreeError`` naming where it
is), and ``describe`` checks that its skeleton rebuilds exactly the tree structure it was
given, so a new kind of node fails loudly instead of restoring as something else.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jax_llm_runtime.models.layers.linear import QuantizedWeight
from jax_llm_runtime.models.state import ModelWeights
from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedLayer, PackedWeight

Skeleton = dict[str, Any]
NODE_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (PackedWeight, PackedLayer, QuantizedWeight)
}
_STATIC_TYPES = (type(None), bool, int, float, str)


class WeightTreeError(ValueError):
    """A weight tree that a skeleton cannot describe, or a skeleton that rebuilds no tree."""


def describe(tree: Any) -> tuple[Skeleton, dict[str, Any]]:
    """The skeleton of ``tree`` and the plain nested dict of its arrays (see the module
    docstring). Raises WeightTreeError for a node it cannot describe."""
    skeleton, arrays = _describe(tree, "weights")
    graphdef = getattr(tree, "graphdef", None)
    rebuilt = assemble(skeleton, arrays, lambda _: graphdef)
    if jax.tree.structure(rebuilt) != jax.tree.structure(tree):
        raise WeightTreeError(
            "the weight tree's description does not rebuild its structure: "
            f"{jax.tree.structure(tree)} became {jax.tree.structure(rebuilt)}"
        )
    return skeleton, arrays or {}


def assemble(
    skeleton: Skeleton, arrays: Any, graphdef_for: Callable[[dict], Any] | None = None
) -> Any:
    """The pytree of ``skeleton`` with its arrays taken from ``arrays`` (``describe``'s plain
    dict, or orbax's restore of it); a split model's graph definition is
    ``graphdef_for(declared)``. Raises WeightTreeError for a malformed skeleton or a missing
    array."""
    kind = skeleton.get("kind")
    if kind == "none":
        return None
    if kind == "array":
        if arrays is None:
            raise WeightTreeError(f"no array for a leaf of shape {skeleton.get('shape')}")
        return arrays
    children = {
        key: assemble(child, arrays.get(key) if isinstance(arrays, dict) else None, graphdef_for)
        for key, child in _children(skeleton)
    }
    if kind == "dict":
        return {int(k): v for k, v in children.items()} if skeleton.get("int_keys") else children
    if kind == "model":
        if graphdef_for is None:
            raise WeightTreeError("a split model's skeleton needs its graph definition")
        return ModelWeights(graphdef_for(skeleton["declared"]), children["state"])
    if kind in ("tuple", "list"):
        items = [children[str(i)] for i in range(len(children))]
        return tuple(items) if kind == "tuple" else items
    cls = NODE_TYPES.get(skeleton.get("type"))
    if cls is None:
        raise WeightTreeError(f"unknown node type {skeleton.get('type')!r}")
    return cls(**children, **skeleton.get("static", {}))


def abstract_arrays(skeleton: Skeleton, sharding_for: Callable[[Skeleton], Sharding]) -> Any:
    """The plain dict of ``describe`` with a ``jax.ShapeDtypeStruct`` for every array, placed by
    ``sharding_for(array skeleton)``: the target orbax restores into."""
    kind = skeleton.get("kind")
    if kind == "none":
        return None
    if kind == "array":
        shape = tuple(int(n) for n in skeleton["shape"])
        dtype = jnp.dtype(skeleton["dtype"])
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_for(skeleton))
    out = {key: abstract_arrays(child, sharding_for) for key, child in _children(skeleton)}
    return {key: value for key, value in out.items() if value is not None} or None


def partition_spec(leaf: Skeleton) -> PartitionSpec:
    """The ``PartitionSpec`` an array skeleton was placed with (replicated when it had none)."""
    parts = leaf.get("spec") or []
    return PartitionSpec(*(tuple(p) if isinstance(p, list) else p for p in parts))


def with_static(skeleton: Skeleton, name: str, old: Any, new: Any) -> Skeleton:
    """A copy of ``skeleton`` whose nodes' static field ``name`` holding ``old`` holds ``new``
    (a runtime choice such as the matmul operands, not a property of the stored arrays)."""
    out = copy.deepcopy(skeleton)
    for node in _nodes(out):
        static = node.get("static", {})
        if name in static and static[name] == old:
            static[name] = new
    return out


def _nodes(skeleton: Skeleton) -> Iterator[Skeleton]:
    if skeleton.get("kind") == "node":
        yield skeleton
    if skeleton.get("kind") not in ("array", "none"):
        for _, child in _children(skeleton):
            yield from _nodes(child)


def _children(skeleton: Skeleton) -> list[tuple[str, Skeleton]]:
    kind = skeleton.get("kind")
    if kind in ("dict", "model"):
        return list(skeleton["items"].items())
    if kind in ("tuple", "list"):
        return [(str(i), child) for i, child in enumerate(skeleton["items"])]
    if kind == "node":
        return list(skeleton["fields"].items())
    raise WeightTreeError(f"unknown node kind {kind!r}")


def _describe(node: Any, where: str) -> tuple[Skeleton, Any]:
    """``node``'s skeleton and its arrays (None where it holds none)."""
    if node is None:
        return {"kind": "none"}, None
    if isinstance(node, jax.Array):
        return _array(node), node
    if isinstance(node, ModelWeights):
        skeleton, arrays = _container("model", {"state": _describe(node.state, where)})
        return {**skeleton, "declared": node.model().declaration()}, arrays
    if type(node) is dict:
        return _dict(node, where)
    if type(node) in (tuple, list):
        described = {str(i): _describe(v, f"{where}[{i}]") for i, v in enumerate(node)}
        skeleton, arrays = _container("dict", described)
        return {"kind": type(node).__name__, "items": list(skeleton["items"].values())}, arrays
    if NODE_TYPES.get(type(node).__name__) is type(node):
        return _dataclass(node, where)
    raise WeightTreeError(
        f"{where} is a {type(node).__name__}, which a prepared checkpoint cannot hold "
        "(runtime.loading.weight_tree.NODE_TYPES lists the node types it can)"
    )


def _dict(node: dict, where: str) -> tuple[Skeleton, Any]:
    """A dict with string keys, or with int keys (a module list's indices, kept as strings)."""
    ints = bool(node) and all(type(key) is int for key in node)
    bad = [key for key in node if not isinstance(key, str)] if not ints else []
    if bad:
        raise WeightTreeError(f"{where} has a key that is not a string: {bad[0]!r}")
    described = {str(key): _describe(v, f"{where}.{key}") for key, v in node.items()}
    skeleton, arrays = _container("dict", described)
    return ({**skeleton, "int_keys": True} if ints else skeleton), arrays


def _container(kind: str, described: dict[str, tuple[Skeleton, Any]]) -> tuple[Skeleton, Any]:
    arrays = {key: a for key, (_, a) in described.items() if a is not None}
    return {"kind": kind, "items": {key: s for key, (s, _) in described.items()}}, arrays or None


def _dataclass(node: Any, where: str) -> tuple[Skeleton, Any]:
    children, static = {}, {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if f.metadata.get("pytree_node", True):
            children[f.name] = _describe(value, f"{where}.{f.name}")
        elif isinstance(value, _STATIC_TYPES):
            static[f.name] = value
        else:
            raise WeightTreeError(
                f"{where}.{f.name} is a static {type(value).__name__}, not a JSON value"
            )
    skeleton, arrays = _container("node", children)
    fields = skeleton.pop("items")
    return {**skeleton, "type": type(node).__name__, "fields": fields, "static": static}, arrays


def _array(leaf: jax.Array) -> Skeleton:
    sharding = leaf.sharding
    spec = None
    if isinstance(sharding, NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    return {
        "kind": "array",
        "shape": list(leaf.shape),
        "dtype": leaf.dtype.name,
        "spec": spec,
        "memory_kind": sharding.memory_kind,
    }
