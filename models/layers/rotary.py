"""Rotary position embeddings (HF "rotate_half" convention), with linear and llama3 scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings. ``rotary_dim`` may be smaller than head_dim (partial rotary).

    ``rope_type`` "linear" divides every frequency by ``factor``; "llama3" divides only the low
    frequencies (wavelength above ``original_max_position_embeddings / low_freq_factor``) and
    interpolates smoothly up to ``original_max_position_embeddings / high_freq_factor``.
    """

    theta: float
    rotary_dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and >= 2, got {self.rotary_dim}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope scaling {self.rope_type!r} is not supported ({', '.join(ROPE_TYPES)} are)"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if self.original_max_position_embeddings is None:
                raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(
                    "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                    f"{self.low_freq_factor} and {self.high_freq_factor}"
                )

    def inv_freq(self) -> np.ndarray:  # [rotary_dim // 2] float32
        exponents = np.arange(0, self.rotary_dim, 2, dtype=np.float64) / self.rotary_dim
        inv_freq = (1.0 / (self.theta**exponents)).astype(np.float32)
        if self.rope_type == "linear":
            return (inv_freq / np.float32(self.factor)).astype(np.float32)
        if self.rope_type == "llama3":
            return self._llama3_inv_freq(inv_freq)
        return inv_freq

    def _llama3_inv_freq(
        self,
        inv_freq: np.ndarray,  # [rotary_dim // 2] float32, unscaled
    ) -> np.ndarray:  # [rotary_dim // 2] float32
        old_len = float(self.original_max_position_embeddings)
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        inv = inv_freq.astype(np.float64)
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_freq_wavelen, inv / self.factor, inv)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_from_hf(hf: dict[str, Any], rotary_dim: int) -> RopeConfig:
    """Rope settings from an HF config dict: ``rope_parameters`` (transformers 5) or the older
    top-level ``rope_theta`` plus ``rope_scaling`` dict (whose kind may be keyed ``type``)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeConfig(theta=float(theta), rotary_dim=rotary_dim)
    original = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rotary_dim=rotary_dim,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if original is None else int(original),
    )


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
