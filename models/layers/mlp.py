"""Feed-forward blocks."""

from __future__ import annotations

import jax

from models.layers.linear import linear


def gated_mlp(
    x: jax.Array,  # [..., hidden]
    gate: jax.Array,  # [hidden, intermediate]
    up: jax.Array,  # [hidden, intermediate]
    down: jax.Array,  # [intermediate, hidden]
) -> jax.Array:  # [..., hidden]
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    return linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)
