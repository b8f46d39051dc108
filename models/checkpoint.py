"""Checkpoint tensors into a ``Decoder``'s declared parameters: the split model ``forward`` takes.

The declarations (``models.layers``) say every field's shape; the architecture's rules map
checkpoint names onto fields (``models.weights``, which streams the tensors into host arrays
and checks every key, index and shape). A field declared by several segments (the attention
of DeepSeek's dense and MoE layers) is one checkpoint stack over all their layers, cut per
segment here. Which projections become ``QuantizedLinear``s is known once the tensors are read
(a quantized checkpoint's packed ones, or all of them with ``--isq``), so the model is declared
again with them before its state is filled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_llm_runtime.models.decoder import (
    PACKED_FIELDS,
    QUANTIZED_FIELDS,
    Decoder,
    DecoderConfig,
    packed_head_for,
)
from jax_llm_runtime.models.isq import ISQ_TYPES, packer
from jax_llm_runtime.models.layers.expert_offload import (
    EXPERT_FIELDS,
    HOST_SUFFIX,
    split_stack,
    to_host_memory,
)
from jax_llm_runtime.models.layers.linear import quantize_int8
from jax_llm_runtime.models.layers.params import params
from jax_llm_runtime.models.state import ModelWeights, nested
from jax_llm_runtime.models.weights import (
    LayerSlots,
    Packing,
    WeightLoadError,
    WeightRule,
    layer_slot,
    load_host_weights,
)
from jax_llm_runtime.pallas_kernels.dequant_matmul import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul import native as native_dequant

Path = tuple[Any, ...]


def load(
    cfg: DecoderConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: jnp.dtype,
    num_tensors: int | None = None,
    *,
    rules: Sequence[WeightRule],
) -> ModelWeights:
    """Checkpoint tensors (HF names, mapped by ``rules``) -> the split model ``forward`` takes."""
    declared = Decoder(cfg, dtype)
    stacks = checkpoint_shapes(declared)
    shapes, first_layer, variants = stacks
    dtypes = {  # fields declared in another dtype than the run's (a per-layer table)
        var.get_metadata("field"): var.get_value().dtype
        for path, var in params(declared)
        if path[0] != "segments" and var.get_value().dtype != jnp.dtype(dtype)
    }
    fields = {_field(name): name for name in shapes}
    # int8 quantizes float weights on the device (``_device``): packed ones come dequantized.
    packing = Packing(
        fields=frozenset()
        if cfg.quantization == "int8"
        else frozenset(name for name in shapes if _field(name) in PACKED_FIELDS),
        quantize=packer(cfg.quantization) if cfg.quantization in ISQ_TYPES else None,
    )
    head: dict[str, HostPacked] = {}
    tensors = _keep_packed_head(cfg, tensors, rules, head)
    host = load_host_weights(
        shapes, rules, tensors, dtype, num_tensors, first_layer, packing, variants, dtypes
    )
    quantized = {_field(name) for name, value in host.items() if isinstance(value, HostPacked)}
    if cfg.quantization == "int8":
        quantized |= QUANTIZED_FIELDS & fields.keys()
    model = Decoder(cfg, dtype, frozenset(quantized), packed_head=bool(head))
    values = _fill(cfg, model, host, stacks, head)
    return ModelWeights(nnx.graphdef(model), nested(values))


def load_renamed(
    rename: Callable[[str], str],
    cfg: DecoderConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: jnp.dtype,
    num_tensors: int | None = None,
    *,
    rules: Sequence[WeightRule],
) -> ModelWeights:
    """``load`` of a checkpoint whose names ``rename`` spells the way ``rules`` read them (a
    vision-language checkpoint's text model: the encoder's tensors were taken out before)."""
    named = ((rename(name), value) for name, value in tensors)
    return load(cfg, named, dtype, num_tensors, rules=rules)


# A field's stack for the layers whose shape differs from the field's first layers' (see
# ``checkpoint_shapes``) is named ``<field>@<first layer of the stack>``.
_STACK = "@"


def _field(stack: str) -> str:
    """The field a stack of ``checkpoint_shapes`` holds."""
    return stack.split(_STACK)[0]


Stacks = tuple[dict[str, tuple[int, ...]], dict[str, LayerSlots], dict[str, dict[int, str]]]


def checkpoint_shapes(model: Decoder) -> Stacks:
    """Every field's shape as the checkpoint fills it (a segment's field stacked over all the
    layers that declare it; an expert stack with all its experts, offloaded or not), where each
    stacked field's layers sit in its stack (the layer it starts at when its segments are
    contiguous, else each declaring layer's slot: MoE layers alternating with dense ones), and
    the stacks of fields whose layers differ in shape: a field is one stack per shape (Gemma 4's
    wider MLPs in its last layers), each layer's named in ``variants[field][layer]``
    (``models.weights.load_host_weights``)."""
    offload = model.cfg.moe.offload if model.cfg.moe is not None else None
    shapes: dict[str, tuple[int, ...]] = {}
    runs: dict[str, list[tuple[int, int, tuple[int, ...]]]] = {}
    for path, var in params(model):
        if var.has_metadata("memory_kind"):
            continue  # offloaded experts: cut from the resident field's checkpoint stack
        name, shape = var.get_metadata("field"), tuple(var.get_value().shape)
        if path[0] != "segments":
            shapes[name] = shape
            continue
        if offload is not None and name in EXPERT_FIELDS:
            shape = (shape[0], model.cfg.moe.num_experts, *shape[2:])
        segment = model.segments[path[1]]
        runs.setdefault(name, []).append((segment.start, segment.end, shape))
    first: dict[str, LayerSlots] = {}
    variants: dict[str, dict[int, str]] = {}
    for name, parts in runs.items():
        parts.sort()
        by_shape: dict[tuple[int, ...], list[tuple[int, int, tuple[int, ...]]]] = {}
        for part in parts:
            by_shape.setdefault(part[2][1:], []).append(part)
        for group in by_shape.values():
            stack = name if group[0] is parts[0] else f"{name}{_STACK}{group[0][0]}"
            layers = [layer for start, end, _ in group for layer in range(start, end)]
            pairs = itertools.pairwise(group)
            contiguous = all(end == start for (_, end, _), (start, _, _) in pairs)
            first[stack] = group[0][0] if contiguous else {n: i for i, n in enumerate(layers)}
            shapes[stack] = (len(layers), *group[0][2][1:])
            if stack != name:
                variants.setdefault(name, {}).update(dict.fromkeys(layers, stack))
    return shapes, first, variants


def _fill(
    cfg: DecoderConfig,
    model: Decoder,
    host: dict[str, np.ndarray | HostPacked],
    stacks: Stacks,
    head: dict[str, HostPacked],
) -> list[tuple[Path, Any]]:
    """Every declared parameter's path with its value on the device. Each host array is dropped once
    it is there, so host memory peaks near one copy of the weights."""
    _, first_layer, variants = stacks
    by_stack: dict[str, list[tuple[Path, nnx.Variable]]] = {}
    for path, var in params(model):
        name = var.get_metadata("field")
        base = name[: -len(HOST_SUFFIX)] if var.has_metadata("memory_kind") else name
        if path[0] == "segments":
            base = variants.get(base, {}).get(model.segments[path[1]].start, base)
        by_stack.setdefault(base, []).append((path, var))
    values = []
    if head:
        host.pop("lm_head", None)  # the float head the loader made of it: replaced
        ((path, var),) = by_stack.pop("lm_head")
        values.append((path, _checked(var, head["lm_head"].to_device())))
    for name in list(host):
        array = host.pop(name)
        cut: dict[int, Any] = {}
        for path, var in by_stack.pop(name):
            value = array
            if path[0] == "segments":
                value = cut.get(path[1])
                if value is None:
                    value = cut[path[1]] = _segment_part(cfg, model, path[1], _field(name),
                                                         array, first_layer[name])  # fmt: skip
            if isinstance(value, tuple):  # expert stacks: (resident, offloaded)
                value = value[1 if var.has_metadata("memory_kind") else 0]
            values.append((path, _checked(var, _device(cfg, var, _field(name), value))))
    if by_stack:
        raise WeightLoadError(f"no checkpoint value for the declared fields {sorted(by_stack)}")
    return values


def _segment_part(
    cfg: DecoderConfig,
    model: Decoder,
    index: int,
    name: str,
    array: np.ndarray | HostPacked,  # [the field's layers, ...]
    first: LayerSlots,
) -> Any:
    """Segment ``index``'s layers of a stacked host field; an offloaded expert stack as its
    (resident, offloaded) stacks."""
    segment = model.segments[index]
    lo, n = layer_slot(first, segment.start), segment.end - segment.start
    rows = (array.codes if isinstance(array, HostPacked) else array).shape[0]
    part = array if lo == 0 and n == rows else array[lo : lo + n]
    offload = cfg.moe.offload if cfg.moe is not None else None
    if offload is not None and name in EXPERT_FIELDS:
        return split_stack(offload, cfg.moe.num_experts, part)
    return part


def _device(cfg: DecoderConfig, var: nnx.Variable, name: str, value: Any) -> Any:
    """A host value on the device: packed, int8-quantized (``--isq int8``) or as it is; an
    offloaded expert stack straight into pinned host memory, never through the device's."""
    if var.has_metadata("memory_kind"):
        return to_host_memory(value, cfg.operand_dtype)
    if isinstance(value, HostPacked):
        return value.to_device(cfg.operand_dtype)
    if cfg.quantization == "int8" and name in QUANTIZED_FIELDS:
        return quantize_int8(value, cfg.operand_dtype)
    return jnp.asarray(value)


def _checked(var: nnx.Variable, value: Any) -> Any:
    """``value`` for ``var``: its (logical) shape must be the declared one."""
    declared = tuple(var.get_value().shape)
    if tuple(value.shape) != declared:
        raise WeightLoadError(
            f"{var.get_metadata('field')!r} has shape {tuple(value.shape)}, declared {declared}"
        )
    return value


def _keep_packed_head(
    cfg: DecoderConfig,
    tensors: Iterable[tuple[str, np.ndarray | HostPacked]],
    rules: Sequence[WeightRule],
    head: dict[str, HostPacked],
) -> Iterator[tuple[str, np.ndarray | HostPacked]]:
    """``tensors`` unchanged; where native kernels run, the checkpoint's LM head (or tied
    embedding) is also kept in ``head["lm_head"]`` when it comes packed, and replaces the float
    head the loader makes of it: the native kernel reads it in its own type, a quarter or less
    of the float32 bytes that a decode step otherwise reads whole (a tied embedding also stays
    float, for the lookups)."""
    # A packed head the kernel does not take is dequantized whole on every step: it stays
    # packed only where the kernel was measured faster for the head's calls of one row and more,
    # or, for a tied embedding (whose float copy stays anyway), faster for one row: lone rows
    # then read it packed and batches the float copy (``Decoder.logits``).
    if not (cfg.native_kernels and packed_head_for(cfg, rows=1) and native_dequant.available()):
        yield from tensors
        return
    source = "embed" if cfg.tie_word_embeddings else "lm_head"
    for key, value in tensors:
        if isinstance(value, HostPacked) and value.codes.ndim == 2:
            rule = next((r for r in rules if r.match(key)), None)
            if rule is not None and rule.fields == (source,):
                head["lm_head"] = value  # [hidden, vocab]: GGUF rows are output channels
        yield key, value
