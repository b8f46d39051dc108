"""Normalisation layers: RMSNorm, Gemma's RMSNorm (weight stored as an offset from 1), LayerNorm.

Their means are summed in one fixed order whatever the number of rows (``row_mean``): XLA:CPU
vectorizes a reduction differently for 1, 2-4 and 16 rows, and the results then differ in the
last bit. That alone made a request's greedy tokens depend on its batch once activations are
rounded to int8 (``--matmul-dtype int8``), where a last-bit change can move a code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.layers.params import Block, declare

NORM_KINDS = ("rms", "rms_one", "layer")


@dataclass(frozen=True)
class NormConfig:
    """``rms``: x / rms(x) * w. ``rms_one``: x / rms(x) * (1 + w) (Gemma checkpoints store w - 1).
    ``layer``: LayerNorm, (x - mean) / std * w + b (the bias weight is optional)."""

    kind: str = "rms"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.kind not in NORM_KINDS:
            raise ValueError(f"norm kind must be one of {', '.join(NORM_KINDS)}, got {self.kind!r}")
        if not self.eps > 0:
            raise ValueError(f"norm eps must be > 0, got {self.eps}")


def apply_norm(
    cfg: NormConfig,
    x: jax.Array,  # [..., dim]
    weight: jax.Array,  # [dim] (or any shape broadcasting against x's trailing axes)
    bias: jax.Array | None = None,  # like weight; LayerNorm only
    dim: jax.Array | None = None,  # [] (traced): x's real width, its features past it being zero
) -> jax.Array:  # like x
    """Normalise over the last axis in float32; the result has x's dtype. With ``dim``, an RMS
    norm's mean is over the first ``dim`` features (a head zero-padded to a wider one)."""
    xf = x.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    if cfg.kind == "layer":
        xf = xf - row_mean(xf)
        out = xf * jax.lax.rsqrt(row_mean(xf * xf) + cfg.eps) * w
        if bias is not None:
            out = out + bias.astype(jnp.float32)
        return out.astype(x.dtype)
    mean_square = row_mean(xf * xf)
    if dim is not None:
        mean_square = mean_square * (x.shape[-1] / dim.astype(jnp.float32))
    xf = xf * jax.lax.rsqrt(mean_square + cfg.eps)
    return (xf * (1.0 + w if cfg.kind == "rms_one" else w)).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in x's dtype.  x: [..., hidden]; weight: [hidden]."""
    return apply_norm(NormConfig("rms", eps), x, weight)


def row_mean(x: jax.Array) -> jax.Array:  # [..., n] -> [..., 1]
    """The mean over the last axis, summed in an order that depends on ``n`` alone: the row is
    padded with zeros to a power of two, then its halves are added until one column is left.
    Elementwise adds are exact per element, so each row's sum is the same however many rows
    there are."""
    n = x.shape[-1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x / n


class Norm(Block):
    """A norm's weight (``field``) and, for LayerNorm with ``bias``, its bias (``field_b``), of
    ``shape`` (stacked layers first) along logical ``axes``."""

    def __init__(
        self,
        cfg: NormConfig,
        shape: Sequence[int],
        axes: Sequence[str],
        dtype: jnp.dtype,
        field: str,
        bias: bool = True,
    ) -> None:
        self.cfg = cfg
        self.weight = declare(shape, dtype, axes, field)
        with_bias = bias and cfg.kind == "layer"
        self.bias = declare(shape, dtype, axes, field + "_b") if with_bias else None

    def __call__(
        self,
        x: jax.Array,  # [..., dim]
        width: jax.Array | None = None,  # [] int32: x's real width (``apply_norm``'s dim)
    ) -> jax.Array:  # like x
        bias = None if self.bias is None else self.bias.get_value()
        return apply_norm(self.cfg, x, self.weight.get_value(), bias, width)
