"""Pure-jnp dequantization and dequant-matmul: the numerical reference, and the CPU path.

``dequantize`` evaluates the formula of ``formats`` in float32. ``dequant_matmul`` has the
kernel's signature; it multiplies without a float copy of the weight when there are few rows
(decode), and dequantizes then calls one dot otherwise (see ``ops``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.dequant_matmul.formats import PackedWeight, evaluate, unpack_planes


def _validate(x: jax.Array, w: PackedWeight) -> None:
    if w.planes[0].ndim != 2:
        raise ValueError(f"the weight must be one [in, out] matrix, got shape {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight has {w.shape[0]}")


def dequantize(w: PackedWeight) -> jax.Array:  # float32 [..., in, out]
    """Every element as float32, bit-exact with the format's own dequantizer."""
    q = unpack_planes(w.planes, w.bits)  # int32 [..., in, out]
    return evaluate(jnp, q, w.d, w.sc, w.z, w.zero, w.mn, w.m)


def dequant_matmul(
    x: jax.Array,  # [num_tokens, in]
    w: PackedWeight,  # [in, out]
) -> jax.Array:  # [num_tokens, out] float32
    """``x @ dequantize(w)`` accumulated in float32."""
    _validate(x, w)
    return jnp.dot(x.astype(jnp.float32), dequantize(w), preferred_element_type=jnp.float32)
