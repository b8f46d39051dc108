"""Frequency scaling for rotary embeddings: llama3, yarn and longrope tables, and their cos/sin gain.

Everything here is host-side numpy on the ``rotary_dim // 2`` inverse frequencies: the tables are
built once per config and enter the jitted graph as constants. The math is done in float64 and
rounded to float32 once at the end, so the tables agree with HF's float32 computation to within
an ulp.
"""

from __future__ import annotations

import math

import numpy as np


def base_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:  # [rotary_dim // 2] float64
    """The unscaled rope frequencies ``theta ** (-2i / rotary_dim)``."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(
    inv_freq: np.ndarray,  # [rotary_dim // 2] unscaled
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> np.ndarray:  # [rotary_dim // 2] float32
    """Divide the low frequencies by ``factor``, keep the high ones, and blend linearly (in
    ``original / wavelength``) across the band between the two wavelength thresholds."""
    old_len = float(original_max_position_embeddings)
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    inv = inv_freq.astype(np.float64)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's cos/sin gain ``0.1 * mscale * ln(factor) + 1``; 1 when the context is not extended."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(
    theta: float,
    rotary_dim: int,
    factor: float,
    beta_fast: float,
    beta_slow: float,
    original_max_position_embeddings: int,
    truncate: bool,
) -> np.ndarray:  # [rotary_dim // 2] float32
    """YaRN's "NTK-by-parts": dimensions that turn more than ``beta_fast`` times over the original
    context keep their frequency (extrapolate), those that turn fewer than ``beta_slow`` times are
    divided by ``factor`` (interpolate), and a linear ramp over the dimension index joins the two.
    ``truncate`` rounds the ramp ends outward to whole dimensions."""
    inv = base_inv_freq(theta, rotary_dim)

    def dim_for_rotations(rotations: float) -> float:
        # Solves original_len * inv_freq[d] / (2 pi) == rotations for the (fractional) dim d.
        return (
            rotary_dim
            * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(inv.shape[0], dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return (inv / factor * ramp + inv * (1.0 - ramp)).astype(np.float32)


def longrope_attention_factor(factor: float, original_max_position_embeddings: int) -> float:
    """LongRoPE's default cos/sin gain ``sqrt(1 + ln(factor) / ln(original))``; 1 when not extended."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1.0 + math.log(factor) / math.log(original_max_position_embeddings))


def divided_inv_freq(
    inv_freq: np.ndarray,  # [rotary_dim // 2] unscaled
    factors: tuple[float, ...],  # rotary_dim // 2 per-frequency divisors
) -> np.ndarray:  # [rotary_dim // 2] float32
    """Every frequency divided by its own factor: LongRoPE's searched factors, or explicit
    per-frequency factors such as a GGUF ``rope_freqs`` tensor."""
    return (inv_freq.astype(np.float64) / np.asarray(factors, np.float64)).astype(np.float32)
