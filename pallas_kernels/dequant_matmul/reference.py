"""Pure-jnp dequantization and dequant-matmul: the numerical reference, and the CPU path.

``dequantize`` evaluates the formula of ``formats`` in float32. ``dequant_matmul`` has the
kernel's signature and contract: the weight is rounded to ``x``'s dtype and the products are
summed in float32. It dequantizes the matrix, then calls one dot (see ``ops``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import (
    RUN,
    PackedWeight,
    evaluate,
    unpack_planes,
)


def _validate(x: jax.Array, w: PackedWeight) -> None:
    if w.planes[0].ndim != 2:
        raise ValueError(f"the weight must be one [in, out] matrix, got shape {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight has {w.shape[0]}")


def dequantize(w: PackedWeight) -> jax.Array:  # float32 [..., in, out]
    """Every element as float32, bit-exact with the format's own dequantizer."""
    q = unpack_planes(w.planes, w.bits)  # int32 [..., in, out]
    return evaluate(jnp, q, w.d, w.sc, w.z, w.zero, w.mn, w.m, w.codebook)


def dequant_matmul(
    x: jax.Array,  # [num_tokens, in] float32, bfloat16 or float16
    w: PackedWeight,  # [in, out]
    *,
    int8_activations: bool = False,
) -> jax.Array:  # [num_tokens, out] float32
    """``x @ dequantize(w)``: the weight rounded to ``x``'s dtype, summed in float32; with
    ``int8_activations``, ``quantize_activations(x) @ dequantize(w)`` in float32."""
    _validate(x, w)
    if int8_activations:
        return operand_dot(quantize_activations(x), dequantize(w))
    return operand_dot(x, dequantize(w))


def quantize_activations(x: jax.Array) -> jax.Array:  # float32, x's shape
    """``x`` rounded to int8 codes with one scale per ``RUN`` (32) values along the last axis,
    as llama.cpp rounds activations for its quantized dot products (Q8_0), and returned as the
    float32 values those codes stand for: ``d * q`` with ``d = max|x| / 127`` and ``q = x / d``
    rounded to nearest, ties to even. A block holding an infinity or NaN comes back all NaN."""
    *lead, k = x.shape
    if k % RUN:
        raise ValueError(f"int8 activations need a multiple of {RUN} features, got {k}")
    blocks = x.astype(jnp.float32).reshape(*lead, k // RUN, RUN)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    finite = jnp.all(jnp.isfinite(blocks), axis=-1, keepdims=True)
    d = jnp.where(finite, amax / 127.0, jnp.nan)
    q = jnp.where(d > 0, jnp.clip(jnp.round(blocks / jnp.where(d > 0, d, 1.0)), -127, 127), 0.0)
    return (q * d).reshape(x.shape)


def operand_dot(
    x: jax.Array,  # [num_tokens, in] float32, bfloat16 or float16
    w: jax.Array,  # [in, out], any real dtype
) -> jax.Array:  # [num_tokens, out] float32
    """``x @ w`` with ``w`` rounded to ``x``'s dtype and the products summed in float32.

    Products of two bfloat16 (or float16) values are exact in float32, so the result depends
    only on the rounded operands (and the order of the sums), not on the formulation. XLA:CPU
    runs a bfloat16 dot of many rows at 1.7x float32's speed but a single row at a quarter of
    it (measured, BENCHMARKS.md); one row therefore multiplies the rounded values in float32.
    """
    f32 = jnp.float32
    if x.dtype == f32:
        return jnp.dot(x, w.astype(f32), preferred_element_type=f32)
    w = w.astype(x.dtype)
    if x.shape[0] == 1 and jax.default_backend() == "cpu":
        return jnp.dot(x.astype(f32), w.astype(f32), preferred_element_type=f32)
    return jnp.dot(x, w, preferred_element_type=f32)
