"""Strict, declarative checkpoint loading: HF tensor names -> fields of a model's weight pytree.

A model declares the shape of every field (stacked per-layer fields lead with ``num_layers``) and
a table of rules that map checkpoint names onto fields. Loading streams tensors one at a time into
preallocated host arrays, so peak host memory stays close to one copy of the weights. Any
unmapped key, missing parameter or shape mismatch is a ``WeightLoadError`` naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm


class WeightLoadError(ValueError):
    """A checkpoint does not match the model it is loaded into."""


@dataclass(frozen=True)
class WeightRule:
    """Checkpoint names matching ``pattern`` fill ``field``.

    With ``per_layer``, the pattern's first group is the layer index into the stacked field.
    ``transpose`` turns a torch ``[out, in]`` linear weight into our ``[in, out]``.
    A rule with ``field=None`` marks names that are deliberately ignored (e.g. cached rope tables).
    """

    pattern: str
    field: str | None
    transpose: bool = False
    per_layer: bool = False

    def match(self, name: str) -> re.Match[str] | None:
        return re.fullmatch(self.pattern, name)


def load_weights(
    shapes: Mapping[str, tuple[int, ...]],
    rules: Sequence[WeightRule],
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: jnp.dtype,
    num_tensors: int | None = None,
) -> dict[str, jax.Array]:
    """Fill every field of ``shapes`` from ``tensors``; return device arrays of ``dtype``."""
    host = {name: np.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    filled: dict[str, set[int]] = {name: set() for name in shapes}
    stacked: set[str] = set()
    for key, array in tqdm(
        tensors, total=num_tensors, desc="Loading weights", unit="tensor", leave=False
    ):
        rule, match = _find_rule(rules, key)
        if rule.field is None:
            continue
        if rule.field not in host:
            raise WeightLoadError(f"checkpoint key {key!r} maps to unknown field {rule.field!r}")
        value = array.T if rule.transpose else array
        target = host[rule.field]
        index = 0
        if rule.per_layer:
            stacked.add(rule.field)
            index = int(match.group(1))
            if index >= target.shape[0]:
                raise WeightLoadError(f"checkpoint key {key!r}: layer {index} out of range")
            target = target[index]
        if value.shape != target.shape:
            raise WeightLoadError(
                f"checkpoint key {key!r} has shape {tuple(value.shape)}, expected {target.shape}"
            )
        if index in filled[rule.field]:
            raise WeightLoadError(f"checkpoint key {key!r} appears twice")
        target[...] = value
        filled[rule.field].add(index)
    for name, shape in shapes.items():
        expected = set(range(shape[0])) if name in stacked else {0}
        missing = expected - filled[name]
        if missing:
            raise WeightLoadError(
                f"checkpoint has no value for {name!r} (layers {sorted(missing)})"
            )
    return {name: jnp.asarray(array) for name, array in host.items()}


def _find_rule(rules: Sequence[WeightRule], key: str) -> tuple[WeightRule, re.Match[str]]:
    for rule in rules:
        match = rule.match(key)
        if match is not None:
            return rule, match
    raise WeightLoadError(f"checkpoint key {key!r} is not a parameter of this model")
