"""Strict, declarative checkpoint loading: HF tensor names -> the fields of a model's parameters.

A model declares the shape of every field (stacked per-layer fields lead with ``num_layers``) and
a table of rules that map checkpoint names onto fields. Loading streams tensors one at a time into
preallocated host arrays, so peak host memory stays close to one copy of the weights. Any
unmapped key, missing parameter or shape mismatch is a ``WeightLoadError`` naming the key.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jax_llm_runtime.pallas_kernels.dequant_matmul import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.host import dequantize_host, split_out, stack


class WeightLoadError(ValueError):
    """A checkpoint does not match the model it is loaded into."""


@dataclass(frozen=True)
class WeightRule:
    """Checkpoint names matching ``pattern`` fill ``field``.

    With ``per_layer``, the pattern's groups are indices into the field's leading axes in order
    (layer, then e.g. expert). ``transpose`` turns a torch ``[out, in]`` linear weight into our
    ``[in, out]``, and a stack of them (``[experts, out, in]``: one tensor for all of a layer's
    experts) into ``[experts, in, out]``. A tuple of fields splits a fused checkpoint tensor
    (``qkv_proj``, ``gate_up_proj``, a convolution's channels) along its torch output axis (a
    linear weight's, or else its first) into pieces sized by the fields' shapes; with
    ``interleaved`` the tensor is ``[..., in, out]`` already (biases ``[..., out]``) and its
    output columns alternate between the fields (gpt-oss's experts: gate, up, gate, up, ...).
    A rule with ``field=None`` marks names that are deliberately ignored (e.g. cached rope tables).
    """

    pattern: str
    field: str | tuple[str, ...] | None
    transpose: bool = False
    per_layer: bool = False
    interleaved: bool = False

    def match(self, name: str) -> re.Match[str] | None:
        return re.fullmatch(self.pattern, name)

    @property
    def fields(self) -> tuple[str, ...]:
        if self.field is None:
            return ()
        return (self.field,) if isinstance(self.field, str) else self.field


def load_weights(
    shapes: Mapping[str, tuple[int, ...]],
    rules: Sequence[WeightRule],
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: jnp.dtype,
    num_tensors: int | None = None,
    first_layer: Mapping[str, LayerSlots] | None = None,
) -> dict[str, jax.Array]:
    """Fill every field of ``shapes`` from ``tensors``; return device arrays of ``dtype``."""
    host = load_host_weights(shapes, rules, tensors, dtype, num_tensors, first_layer)
    return {name: jnp.asarray(array) for name, array in host.items()}


# Where a stacked field's layers sit in its stack: the layer it starts at (its layers are
# contiguous), or each layer's slot (they are not: MoE layers alternating with dense ones).
LayerSlots = int | Mapping[int, int]


def layer_slot(first: LayerSlots, layer: int) -> int:
    """Layer ``layer``'s slot in a stack (-1, out of range, for a layer that has no slot)."""
    if isinstance(first, Mapping):
        return first.get(layer, -1)
    return layer - first


@dataclass(frozen=True)
class Packing:
    """Which fields keep quantized weights packed, and how float ones get packed.

    A ``HostPacked`` checkpoint value (GGUF block types, GPTQ, AWQ; always ``[in, out]``) that
    maps to one of ``fields`` is stored packed; elsewhere it is dequantized. With ``quantize``,
    every value of ``fields`` is packed at load into its type (in-situ quantization, ``[in, out]``
    float in), a packed one after dequantizing it.
    """

    fields: frozenset[str] = frozenset()
    quantize: Callable[[np.ndarray], HostPacked] | None = None


def load_host_weights(
    shapes: Mapping[str, tuple[int, ...]],
    rules: Sequence[WeightRule],
    tensors: Iterable[tuple[str, np.ndarray | HostPacked]],
    dtype: jnp.dtype,
    num_tensors: int | None = None,
    first_layer: Mapping[str, LayerSlots] | None = None,
    packing: Packing = Packing(),
    variants: Mapping[str, Mapping[int, str]] | None = None,
    dtypes: Mapping[str, jnp.dtype] | None = None,
) -> dict[str, np.ndarray | HostPacked]:
    """Like ``load_weights`` but returns host (numpy) arrays, and ``HostPacked`` for the fields
    that ``packing`` keeps packed.

    ``first_layer[field]`` is the layer a stacked field starts at: a field that exists only for
    layers k.. (DeepSeek's experts after its dense layers) has a leading axis of n - k. It may
    instead map each layer that has the field to its slot (``layer_slot``).

    A field whose layers differ in shape (Gemma 4's wider MLPs in its last layers) is held in
    one stack per shape: ``variants[field][layer]`` names the stack (a key of ``shapes``) of
    each of its layers that is not in the stack named ``field``.

    ``dtypes[name]`` is the dtype of a field held in another than ``dtype`` (Gemma 4's per-layer
    embedding table in bfloat16 under a float32 run).
    """
    dtypes = dtypes or {}
    host = {name: np.empty(shape, dtype=dtypes.get(name, dtype)) for name, shape in shapes.items()}
    packed: dict[str, dict[tuple[int, ...], HostPacked]] = {name: {} for name in packing.fields}
    filled: dict[str, set[tuple[int, ...]]] = {name: set() for name in shapes}
    depth: dict[str, int] = {}
    offsets, variants = first_layer or {}, variants or {}
    for key, array in tqdm(
        tensors, total=num_tensors, desc="Loading weights", unit="tensor", leave=False
    ):
        rule, match = _find_rule(rules, key)
        if not rule.fields:
            continue  # a name the architecture ignores (a vision tower, a cached rope table)
        layer = int(match.group(1)) if rule.per_layer else -1
        targets = tuple(variants.get(f, {}).get(layer, f) for f in rule.fields)
        for field in targets:
            if field not in host:
                raise WeightLoadError(f"checkpoint key {key!r} maps to unknown field {field!r}")
        value = _prepare(array, rule, all(f in packed for f in targets), packing)
        pieces = _split(key, rule, value, host, targets) if len(targets) > 1 else [value]
        for field, piece in zip(targets, pieces, strict=True):
            index: tuple[int, ...] = ()
            if rule.per_layer:
                index = tuple(int(g) for g in match.groups())
                index = (layer_slot(offsets.get(field, 0), index[0]), *index[1:])
                depth[field] = len(index)
            if isinstance(piece, HostPacked):
                _check_index(key, shapes[field], index)
                _check_shape(key, shapes[field][len(index) :], piece.codes.shape)
                packed[field][index] = piece
            else:
                _store(key, host[field], index, _ours(piece) if rule.transpose else piece)
            if index in filled[field]:
                raise WeightLoadError(f"checkpoint key {key!r} appears twice")
            filled[field].add(index)
    for name, shape in shapes.items():
        expected = set(itertools.product(*(range(n) for n in shape[: depth.get(name, 0)])))
        missing = expected - filled[name]
        if missing:
            raise WeightLoadError(
                f"checkpoint has no value for {name!r} (indices {sorted(missing)[:8]})"
            )
    _finish_packed(host, packed, filled)
    return host


def _prepare(
    value: np.ndarray | HostPacked, rule: WeightRule, keep: bool, packing: Packing
) -> np.ndarray | HostPacked:
    """A checkpoint value as it will be stored: for a packed field, packed (and with
    ``packing.quantize``, quantized now, re-quantized if it came packed in another type); else a
    float array in the checkpoint's (torch) layout."""
    if not keep:
        if isinstance(value, HostPacked):
            return np.swapaxes(dequantize_host(value), -1, -2)
        return value
    if packing.quantize is None:
        return value
    if isinstance(value, HostPacked):
        weight = dequantize_host(value)
    else:
        weight = np.asarray(_ours(value) if rule.transpose else value)
    quantized = packing.quantize(weight)
    return quantized if isinstance(quantized, HostPacked) else value


def _finish_packed(
    host: dict[str, np.ndarray | HostPacked],
    packed: Mapping[str, Mapping[tuple[int, ...], HostPacked]],
    filled: Mapping[str, set[tuple[int, ...]]],
) -> None:
    """Stack each packed field; a field with some float values stays float throughout."""
    for name, parts in packed.items():
        if parts and len(parts) == len(filled[name]):
            host[name] = _stack_packed(parts)
            continue
        for index, part in parts.items():
            _store(name, host[name], index, dequantize_host(part))


def _stack_packed(parts: Mapping[tuple[int, ...], HostPacked]) -> HostPacked:
    """Per-index pieces stacked along their index axes (layer, then expert)."""
    if list(parts) == [()]:
        return parts[()]
    firsts = sorted({index[0] for index in parts})
    return stack(
        [
            _stack_packed({index[1:]: p for index, p in parts.items() if index[0] == i})
            for i in firsts
        ]
    )


def _check_index(key: str, shape: tuple[int, ...], index: tuple[int, ...]) -> None:
    for axis, i in enumerate(index):
        if not 0 <= i < shape[axis]:
            raise WeightLoadError(f"checkpoint key {key!r}: index {i} on axis {axis} out of range")


def _check_shape(key: str, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise WeightLoadError(f"checkpoint key {key!r} has shape {tuple(got)}, expected {expected}")


def _split(
    key: str,
    rule: WeightRule,
    value: np.ndarray | HostPacked,
    host: Mapping[str, np.ndarray],
    targets: tuple[str, ...],
) -> list[np.ndarray] | list[HostPacked]:
    """Cut a fused torch ``[out, in]`` tensor (or a packed ``[in, out]`` one) into the output
    widths of the fields' stacks ``targets``; an interleaved one into every n-th output
    column."""
    if rule.interleaved:
        return _split_interleaved(key, rule, value, host, targets)
    # The output axis of each field: its last if transposed, else the one the tensor's first
    # axis fills (a linear weight's [out, in], a convolution's [channels, 1, kernel]).
    back = -1 if rule.transpose else (-2 if isinstance(value, HostPacked) else -value.ndim)
    sizes = [host[f].shape[back] for f in targets]
    axis = -2 if rule.transpose else 0  # of a float value: its torch output axis
    rows = value.codes.shape[-1] if isinstance(value, HostPacked) else value.shape[axis]
    if rows != sum(sizes):
        raise WeightLoadError(
            f"checkpoint key {key!r} has {rows} output rows, expected "
            f"{' + '.join(map(str, sizes))} for {', '.join(rule.fields)}"
        )
    if isinstance(value, HostPacked):
        return split_out(value, sizes)
    return np.split(value, np.cumsum(sizes)[:-1], axis=axis)


def _ours(value: np.ndarray) -> np.ndarray:
    """A torch ``[..., out, in]`` linear weight (or a stack of them) as ``[..., in, out]``."""
    return np.swapaxes(value, -1, -2) if value.ndim >= 2 else value


def _split_interleaved(
    key: str,
    rule: WeightRule,
    value: np.ndarray | HostPacked,
    host: Mapping[str, np.ndarray],
    targets: tuple[str, ...],
) -> list[np.ndarray] | list[HostPacked]:
    n = len(targets)
    sizes = [host[f].shape[-1] for f in targets]
    shape = value.codes.shape if isinstance(value, HostPacked) else value.shape
    if len(set(sizes)) != 1 or shape[-1] != sum(sizes):
        raise WeightLoadError(
            f"checkpoint key {key!r} of shape {tuple(shape)} does not interleave "
            f"{' + '.join(map(str, sizes))} output columns for {', '.join(rule.fields)}"
        )
    if isinstance(value, HostPacked):  # every array is [..., rows, out]
        return [value.map(lambda a, i=i: np.ascontiguousarray(a[..., i::n])) for i in range(n)]
    return [value[..., i::n] for i in range(n)]


def _store(key: str, target: np.ndarray, index: tuple[int, ...], value: np.ndarray) -> None:
    _check_index(key, target.shape, index)
    _check_shape(key, target[index].shape, value.shape)
    target[index] = value


def _find_rule(rules: Sequence[WeightRule], key: str) -> tuple[WeightRule, re.Match[str]]:
    for rule in rules:
        match = rule.match(key)
        if match is not None:
            return rule, match
    raise WeightLoadError(f"checkpoint key {key!r} is not a parameter of this model")


def nested_rules(rules: Sequence[WeightRule], prefix: str, ignored: str) -> tuple[WeightRule, ...]:
    """``rules`` for a multimodal checkpoint whose text model lives under ``model.<prefix>.``
    (Mistral 3, Gemma 3); names matching ``ignored`` (its vision parts) are skipped."""
    nested = tuple(
        WeightRule(
            r.pattern.replace(r"model\.", rf"model\.{prefix}\.", 1),
            r.field,
            r.transpose,
            r.per_layer,
            r.interleaved,
        )
        if r.pattern.startswith(r"model\.")
        else r
        for r in rules
    )
    return (*nested, WeightRule(ignored, None))
