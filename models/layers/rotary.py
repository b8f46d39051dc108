"""Rotary position embeddings (HF "rotate_half" convention)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings. ``rotary_dim`` may be smaller than head_dim (partial rotary)."""

    theta: float
    rotary_dim: int

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and >= 2, got {self.rotary_dim}")

    def inv_freq(self) -> np.ndarray:  # [rotary_dim // 2] float32
        exponents = np.arange(0, self.rotary_dim, 2, dtype=np.float64) / self.rotary_dim
        return (1.0 / (self.theta**exponents)).astype(np.float32)


def apply_rope(
    x: jax.Array,  # [..., seq, num_heads, head_dim]
    positions: jax.Array,  # [..., seq] int32
    rope: RopeConfig,
) -> jax.Array:
    """Rotate the first ``rotary_dim`` features of every head by its token's position."""
    inv_freq = jnp.asarray(rope.inv_freq())
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., seq, rotary_dim // 2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    rot, rest = x[..., : rope.rotary_dim], x[..., rope.rotary_dim :]
    half = rope.rotary_dim // 2
    x1 = rot[..., :half].astype(jnp.float32)
    x2 = rot[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), rest], axis=-1)
