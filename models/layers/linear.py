"""The one linear layer every projection goes through, for plain and quantized weights.

``Linear`` is the module that declares a projection's ``[in, out]`` kernel (and bias) with its
logical axes (``models.layers.params``); ``QuantizedLinear`` is the same declaration for a
kernel that the checkpoint (or ``--isq``) gives packed, and ``projection`` picks one of the two.
Both call ``linear``. ``ExpertLinear`` and ``QuantizedExpertLinear`` (``expert_projection``
picks one) declare a stack of routed experts' ``[experts, in, out]`` kernels the same way and
multiply each row by its own expert's matrix (``models.layers.moe``): ``expert_gathered`` for a
few rows, ``expert_grouped`` for many.

``PackedWeight`` (GGUF block types, GPTQ, AWQ) goes to ``pallas_kernels.dequant_matmul``, and so
does ``PackedLayer``, one layer of a stacked ``PackedWeight`` that the layer scan hands over
whole where native CPU kernels may run (``Segment.scan``, ``models.layers.decoder_layer``).

``QuantizedWeight`` is int8 weight-only quantization with one float32 scale per output channel
(symmetric, round to nearest): ``w ~= q * scale``. XLA:CPU widens int8 to the compute dtype in a
separate pass before the dot; for a layer's projections the widened copy stays in cache, so a
step reads a quarter of the float32 bytes, but a very wide weight spills it and is slower than
float32, so the LM head is not quantized (BENCHMARKS.md has the figures).

Both kinds carry an ``operand_dtype`` (``--matmul-dtype``):

- None (the default) multiplies in the activations' own dtype everywhere, which keeps every
  request's tokens independent of its batch.
- "bfloat16" rounds the activations to bfloat16 and sums the products in float32, faster for
  many rows on CPUs with bfloat16 dots; it moves logits by ~1%, so a request's tokens may then
  depend on what it is batched with. A single row (one sequence decoding alone) keeps the
  activations' dtype: it is bound by reading the weights, and the rounding only slowed it.
- "int8" rounds the activations to int8 blocks of 32 values with one float32 scale each
  (``reference.quantize_activations``, llama.cpp's rounding for its quantized dot products), a
  single row too: each row's rounding and integer sums are its own, so a request's tokens do not
  depend on its batch (``tests/runtime/test_sampling_smollm2.py``). Packed weights then multiply
  in the native CPU kernel's integer dots for any number of rows, and the packed LM head too;
  elsewhere (other backends, ``QuantizedWeight``) the rounded values multiply in float32, which
  gives the same numbers more slowly.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_llm_runtime.models.layers.expert_offload import HOST_SUFFIX, to_device_memory
from jax_llm_runtime.models.layers.params import EXPERTS, Block, declare, layer_axes
from jax_llm_runtime.pallas_kernels.dequant_matmul import (
    PackedLayer,
    PackedWeight,
    dequant_matmul,
    dequant_matmul_group,
    dequantize,
)
from jax_llm_runtime.pallas_kernels.dequant_matmul.reference import (
    operand_dot,
    quantize_activations,
)

OPERAND_DTYPES = (None, "bfloat16", "int8")


@struct.dataclass
class QuantizedWeight:
    """An ``[..., in, out]`` weight stored as int8 with per-output-channel scales."""

    q: jax.Array  # [..., in, out] int8
    scale: jax.Array  # [..., out] float32
    operand_dtype: str | None = struct.field(pytree_node=False, default=None)  # see the module

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


def quantize_int8(weight: np.ndarray, operand_dtype: str | None = None) -> QuantizedWeight:
    """Symmetric per-output-channel int8 of a host ``[..., in, out]`` weight (on the host)."""
    w = np.asarray(weight, np.float32)
    amax = np.max(np.abs(w), axis=-2)  # [..., out]
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
    return QuantizedWeight(q=jnp.asarray(q), scale=jnp.asarray(scale), operand_dtype=operand_dtype)


def linear(
    x: jax.Array,  # [..., in]
    weight: jax.Array | QuantizedWeight | PackedWeight | PackedLayer,  # [in, out]
    bias: jax.Array | None = None,  # [out]
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:  # [..., out] in out_dtype, default x's dtype
    """x @ weight (+ bias), summed in float32 whatever the storage dtype; quantized weights
    round x to their ``operand_dtype`` first."""
    if isinstance(weight, (PackedWeight, PackedLayer)):
        int8 = int8_operands(x, weight.operand_dtype)
        y = dequant_matmul(
            x if int8 else _operands(x, weight.operand_dtype), weight, int8_activations=int8
        )
    elif isinstance(weight, QuantizedWeight):
        flat = _operands(x.reshape(-1, x.shape[-1]), weight.operand_dtype)
        y = operand_dot(flat, weight.q).reshape(*x.shape[:-1], -1)  # int8 is exact in bf16
        y = y * weight.scale.astype(jnp.float32)
    else:
        y = jnp.einsum(
            "...i,io->...o", x, weight.astype(x.dtype), preferred_element_type=jnp.float32
        )
    return _biased(y, bias, out_dtype or x.dtype)


def linear_group(
    x: jax.Array,  # [..., in]
    weights: Sequence[jax.Array | QuantizedWeight | PackedWeight | PackedLayer],  # [in, out_i]
    biases: Sequence[jax.Array | None],  # [out_i] each
    out_dtype: jnp.dtype | None = None,
) -> list[jax.Array]:  # [..., out_i] each
    """``linear`` of each weight on the same ``x``, the same values: packed weights with one
    operand dtype go to ``dequant_matmul_group`` (one native kernel call where it takes them
    all), anything else one by one."""
    packed = all(isinstance(w, (PackedWeight, PackedLayer)) for w in weights)
    if len(weights) < 2 or not packed or len({w.operand_dtype for w in weights}) != 1:
        return [linear(x, w, b, out_dtype) for w, b in zip(weights, biases, strict=True)]
    operand_dtype = weights[0].operand_dtype
    int8 = int8_operands(x, operand_dtype)
    operands = x if int8 else _operands(x, operand_dtype)
    ys = dequant_matmul_group(operands, list(weights), int8_activations=int8)
    return [_biased(y, b, out_dtype or x.dtype) for y, b in zip(ys, biases, strict=True)]


def project(
    x: jax.Array,  # [..., in]
    *layers: Linear,
    out_dtype: jnp.dtype | None = None,
) -> list[jax.Array]:  # [..., out_i] each
    """Each of ``layers`` applied to ``x`` (projections that share an input: a layer's q, k
    and v, an MLP's gate and up), through ``linear_group``."""
    weights = [layer.kernel.get_value() for layer in layers]
    biases = [None if layer.bias is None else layer.bias.get_value() for layer in layers]
    return linear_group(x, weights, biases, out_dtype)


def _biased(y: jax.Array, bias: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


def int8_operands(x: jax.Array, operand_dtype: str | None) -> bool:
    """Whether a packed weight's dot rounds ``x`` to int8 (see the module docstring)."""
    return operand_dtype == "int8"


def _operands(x: jax.Array, operand_dtype: str | None) -> jax.Array:
    """``x`` rounded to a quantized weight's operand dtype (bfloat16: except a single row; see
    the module docstring)."""
    if operand_dtype == "int8":
        return quantize_activations(x)
    if operand_dtype is None or x.size == x.shape[-1]:
        return x
    return x.astype(operand_dtype)


def dense(
    weight: jax.Array | PackedWeight,  # [..., in, out]
    dtype: jnp.dtype,
) -> jax.Array:  # [..., in, out] in dtype
    """A weight's values as a plain array, for the few places that index or group weights
    themselves instead of calling ``linear`` (MoE expert stacks)."""
    if isinstance(weight, PackedWeight):
        return dequantize(weight).astype(dtype)
    return weight.astype(dtype)


def expert_gathered(
    x: jax.Array,  # [num_tokens, in] or [num_tokens, top_k, in]
    weight: jax.Array | PackedWeight,  # [num_experts, in, out]
    experts: jax.Array,  # [num_tokens, top_k] int32
    bias: jax.Array | None = None,  # [num_experts, out]
) -> jax.Array:  # [num_tokens, top_k, out] in x's dtype
    """Each (token, slot) row times its expert's matrix (plus its expert's bias), gathered per
    row: a batched mat-vec that reads only the chosen experts (a token's one row serves all its
    slots). A packed stack gathers the chosen experts' codes and scales, then dequantizes
    them."""
    w = dense(jax.tree_util.tree_map(lambda t: jnp.take(t, experts, axis=0), weight), x.dtype)
    spec = "ti,tkio->tko" if x.ndim == 2 else "tki,tkio->tko"
    y = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + jnp.take(bias, experts, axis=0).astype(jnp.float32)
    return y.astype(x.dtype)


def expert_grouped(
    rows: jax.Array,  # [num_rows, in], sorted by expert
    weight: jax.Array | PackedWeight,  # [num_experts, in, out]
    group_sizes: jax.Array,  # [num_experts] int32: each expert's count of consecutive rows
    bias: jax.Array | None = None,  # [num_experts, out]
) -> jax.Array:  # [num_rows, out] in rows' dtype
    """Each row times its expert's matrix (plus its expert's bias) as one grouped matmul
    (``jax.lax.ragged_dot``) over expert-contiguous row blocks. A packed stack is dequantized
    whole, one layer at a time (inside the layer scan)."""
    y = jax.lax.ragged_dot(
        rows, dense(weight, rows.dtype), group_sizes, preferred_element_type=jnp.float32
    )
    if bias is not None:
        # Rows past the groups' total belong to no expert: they repeat the last bias, unread.
        per_row = jnp.repeat(bias, group_sizes, axis=0, total_repeat_length=rows.shape[0])
        y = y + per_row.astype(jnp.float32)
    return y.astype(rows.dtype)


class Linear(Block):
    """A projection ``x @ kernel (+ bias)``: kernel ``[*lead, in, out]`` along logical axes
    ``(layers..., in_axis, out_axis)``, bias ``[*lead, out]`` along the output axis."""

    def __init__(
        self,
        lead: Sequence[int],
        features: tuple[int, int],  # (in, out)
        axes: tuple[str, str],  # logical axes of (in, out)
        dtype: jnp.dtype,
        field: str,
        bias: str | None = None,  # the bias's field name; None: no bias
    ) -> None:
        stack = layer_axes(lead)
        self.kernel = declare((*lead, *features), dtype, (*stack, *axes), field)
        bias_shape, bias_axes = (*lead, features[1]), (*stack, axes[1])
        self.bias = None if bias is None else declare(bias_shape, dtype, bias_axes, bias)

    def __call__(
        self,
        x: jax.Array,  # [..., in]
        out_dtype: jnp.dtype | None = None,
    ) -> jax.Array:  # [..., out]
        bias = None if self.bias is None else self.bias.get_value()
        return linear(x, self.kernel.get_value(), bias, out_dtype)


class QuantizedLinear(Linear):
    """A ``Linear`` whose kernel is quantized: a ``PackedWeight`` (GGUF block types, GPTQ, AWQ,
    ``--isq`` block types; inside a layer scan where native kernels run, the stack's
    ``PackedLayer``) or an int8 ``QuantizedWeight`` (``--isq int8``). The declaration is the
    logical ``[in, out]`` matrix: every array of the packed value splits along the same axes
    (``runtime.parallel.sharding``)."""


def projection(
    lead: Sequence[int],
    features: tuple[int, int],
    axes: tuple[str, str],
    dtype: jnp.dtype,
    field: str,
    bias: str | None = None,
    quantized: Collection[str] = (),
) -> Linear:
    """A ``QuantizedLinear`` when ``field`` is one of the ``quantized`` fields, else a
    ``Linear``."""
    kind = QuantizedLinear if field in quantized else Linear
    return kind(lead, features, axes, dtype, field, bias)


class ExpertLinear(Block):
    """A stack of routed experts' projections: kernel ``[*lead, experts, in, out]`` along logical
    axes ``(layers..., EXPERTS, in_axis, out_axis)``, and with ``bias`` a bias
    ``[*lead, experts, out]`` (gpt-oss); each row is multiplied by its own expert's matrix. Declared with ``memory_kind="pinned_host"`` (offloaded experts:
    ``models.layers.expert_offload``), the kernel lives in host memory and every call copies it
    to device memory first, so a caller that calls it only under a ``lax.cond`` fetches it only
    when that branch runs."""

    def __init__(
        self,
        lead: Sequence[int],
        experts: int,
        features: tuple[int, int],  # (in, out)
        axes: tuple[str, str],  # logical axes of (in, out)
        dtype: jnp.dtype,
        field: str,
        memory_kind: str | None = None,
        bias: str | None = None,  # the bias's field name; None: no bias
    ) -> None:
        shape, full_axes = (*lead, experts, *features), (*layer_axes(lead), EXPERTS, *axes)
        on_host = {} if memory_kind is None else {"memory_kind": memory_kind}
        self.kernel = declare(shape, dtype, full_axes, field, **on_host)
        bias_shape, bias_axes = (*lead, experts, features[1]), (*full_axes[:-2], axes[1])
        self.bias = None if bias is None else declare(bias_shape, dtype, bias_axes, bias)
        self.offloaded = memory_kind is not None

    @property
    def num_experts(self) -> int:
        return self.kernel.get_value().shape[-3]

    def _weight(self) -> jax.Array | PackedWeight:  # [num_experts, in, out] in device memory
        value = self.kernel.get_value()
        return to_device_memory(value) if self.offloaded else value

    def gathered(
        self,
        x: jax.Array,  # [num_tokens, in] or [num_tokens, top_k, in]
        experts: jax.Array,  # [num_tokens, top_k] int32, indices into this stack
    ) -> jax.Array:  # [num_tokens, top_k, out]
        """``expert_gathered`` with this stack (one layer's, inside the layer scan)."""
        return expert_gathered(x, self._weight(), experts, self._bias())

    def grouped(
        self,
        rows: jax.Array,  # [num_rows, in], sorted by expert
        group_sizes: jax.Array,  # [num_experts] int32
    ) -> jax.Array:  # [num_rows, out]
        """``expert_grouped`` with this stack (one layer's, inside the layer scan)."""
        return expert_grouped(rows, self._weight(), group_sizes, self._bias())

    def _bias(self) -> jax.Array | None:  # [num_experts, out]
        return None if self.bias is None else self.bias.get_value()


class QuantizedExpertLinear(ExpertLinear):
    """An ``ExpertLinear`` whose kernel is packed: a ``PackedWeight`` (GGUF block types, GPTQ,
    AWQ, ``--isq`` block types) with every array leading with the expert axis. The declaration
    is the logical ``[experts, in, out]`` stack: every array of the packed value splits along the
    same axes (``runtime.parallel.sharding``)."""


def expert_projection(
    lead: Sequence[int],
    experts: int,
    features: tuple[int, int],
    axes: tuple[str, str],
    dtype: jnp.dtype,
    field: str,
    quantized: Collection[str] = (),
    memory_kind: str | None = None,
    bias: str | None = None,
) -> ExpertLinear:
    """A ``QuantizedExpertLinear`` when ``field`` is one of the ``quantized`` fields (an
    offloaded stack, ``e_gate_host``, when its resident field ``e_gate`` is), else an
    ``ExpertLinear``."""
    kind = QuantizedExpertLinear if field.removesuffix(HOST_SUFFIX) in quantized else ExpertLinear
    return kind(lead, experts, features, axes, dtype, field, memory_kind, bias)
