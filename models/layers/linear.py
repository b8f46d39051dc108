"""The one linear layer every projection goes through, for plain and quantized weights.

``Linear`` is the module that declares a projection's ``[in, out]`` kernel (and bias) with its
logical axes (``models.layers.params``); ``QuantizedLinear`` is the same declaration for a
kernel that the checkpoint (or ``--isq``) gives packed, and ``projection`` picks one of the two.
Both call ``linear``.

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

from jax_llm_runtime.models.layers.params import Block, declare, layer_axes
from jax_llm_runtime.pallas_kernels.dequant_matmul import (
    PackedLayer,
    PackedWeight,
    dequant_matmul,
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
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


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
