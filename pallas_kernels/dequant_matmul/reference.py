"""Pure-jnp dequantization and dequant-matmul: the numerical reference, and the CPU path.

``dequantize`` evaluates the formula of ``formats`` in float32. ``dequant_matmul`` has the
kernel's signature; it multiplies without a float copy of the weight when there are few rows
(decode), and dequantizes then calls one dot otherwise (see ``ops``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.dequant_matmul.formats import PackedWeight, unpack_planes


def _validate(x: jax.Array, w: PackedWeight) -> None:
    if w.planes[0].ndim != 2:
        raise ValueError(f"the weight must be one [in, out] matrix, got shape {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight has {w.shape[0]}")


def _per_group(a: jax.Array, groups: int) -> jax.Array:  # [..., g, out] -> [..., groups, 1, out]
    """A group array repeated to ``groups`` groups (its own groups must divide them)."""
    if a.shape[-2] not in (1, groups):
        a = jnp.repeat(a, groups // a.shape[-2], axis=-2)
    return a[..., :, None, :]


def group_count(w: PackedWeight) -> int:
    """The finest group count among the weight's group arrays."""
    arrays = (w.d, w.sc, w.z, w.mn, w.m)
    return max(a.shape[-2] for a in arrays if a is not None)


def dequantize(w: PackedWeight) -> jax.Array:  # float32 [..., in, out]
    """Every element as float32, bit-exact with the format's own dequantizer."""
    q = unpack_planes(w.planes, w.bits)  # int32 [..., in, out]
    *lead, k, n = q.shape
    groups = group_count(w)
    q = q.reshape(*lead, groups, k // groups, n)
    if w.z is not None:
        q = q - _per_group(w.z, groups).astype(jnp.int32)
    elif w.zero:
        q = q - w.zero
    scale = _per_group(w.d, groups).astype(jnp.float32)
    if w.sc is not None:
        scale = scale * _per_group(w.sc, groups).astype(jnp.float32)
    out = scale * q.astype(jnp.float32)
    if w.mn is not None:
        low = _per_group(w.mn, groups).astype(jnp.float32)
        if w.m is not None:
            low = low * _per_group(w.m, groups).astype(jnp.float32)
        out = out - low
    return out.reshape(*lead, k, n)


def dequant_matmul(
    x: jax.Array,  # [num_tokens, in]
    w: PackedWeight,  # [in, out]
) -> jax.Array:  # [num_tokens, out] float32
    """``x @ dequantize(w)`` accumulated in float32."""
    _validate(x, w)
    return jnp.dot(x.astype(jnp.float32), dequantize(w), preferred_element_type=jnp.float32)
