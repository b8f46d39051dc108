"""The one linear layer every projection goes through (quantized weights will dispatch here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """x @ weight (+ bias).  x: [..., in]; weight: [in, out]; returns [..., out] in x's dtype.

    Accumulates in float32 whatever the storage dtype.
    """
    y = jnp.einsum("...i,io->...o", x, weight.astype(x.dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
