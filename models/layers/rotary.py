"""Rotary position embeddings: one frozen config, its HF translation, and the rotation itself.

The frequency tables for the scaled variants live in ``rope_scaling``; this module decides which
table a token uses and rotates either the two halves of the rotary features (HF "rotate_half",
the default) or adjacent pairs (``interleaved``, as GLM-4 does).

Multimodal RoPE (``mrope_section``, Qwen2-VL to Qwen3-VL) gives each token three positions,
(temporal, height, width): an image's tokens share the temporal one and count their patch's row
and column from it, text tokens have three equal ones. Each rotary frequency turns with one of
the three, as ``mrope_axes`` assigns them; a text token's rotation is then the plain one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.models.layers import rope_scaling

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
# Older checkpoints name a few kinds differently; they map onto a supported kind unchanged.
LEGACY_ROPE_TYPES = {"su": "longrope"}
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")
_FACTOR_LISTS = ("short_factor", "long_factor", "freq_factors")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings, hashable so it can be a static jit argument.

    ``rotary_dim`` may be smaller than head_dim (partial rotary); only the first ``rotary_dim``
    features of a head rotate. ``rope_type`` picks the frequencies:

    - "default": ``theta ** (-2i / rotary_dim)``, each divided by ``freq_factors[i]`` when given
      (precomputed per-frequency divisors, e.g. a GGUF ``rope_freqs`` tensor).
    - "linear": every frequency divided by ``factor``.
    - "llama3": low frequencies divided by ``factor``, blended between the wavelengths
      ``original_max_position_embeddings / {low,high}_freq_factor``.
    - "yarn": frequencies blended between divided-by-``factor`` and unscaled over the dimensions
      that turn between ``beta_slow`` and ``beta_fast`` times in the original context.
    - "longrope": frequencies divided by ``short_factor[i]`` for positions below
      ``original_max_position_embeddings`` and by ``long_factor[i]`` from there on. HF picks one
      table per forward pass from the longest sequence; a paged engine needs every token's rotation
      fixed once its key is cached, so the choice here is per position. The two agree whenever the
      whole sequence fits in the original context.
    - "proportional" (Gemma 4's global layers): the default frequencies of the whole
      ``rotary_dim``, of which only the first ``rotated_fraction`` of the pairs turn (the rest
      have frequency zero), each divided by ``factor``.

    ``attention_factor`` multiplies cos and sin (yarn and longrope only); ``None`` means the
    kind's default, see ``attention_scale``. Factor lists must be tuples (lists are converted).
    """

    theta: float
    rotary_dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float | None = None
    freq_factors: tuple[float, ...] | None = None
    interleaved: bool = False
    rotated_fraction: float = 1.0
    mrope_section: tuple[int, ...] | None = None  # frequencies per (t, h, w) axis
    mrope_interleaved: bool = False  # Qwen3-VL's t, h, w, t, h, w, ... (else Qwen2-VL's runs)

    def __post_init__(self) -> None:
        for name in _FACTOR_LISTS:
            # Lists or arrays would make the config unhashable, and so unusable as a jit static.
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))
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
        if not 0 < self.rotated_fraction <= 1:
            raise ValueError(f"rotated_fraction must be in (0, 1], got {self.rotated_fraction}")
        if self.rotated_fraction != 1 and self.rope_type != "proportional":
            raise ValueError(f"rotated_fraction applies to proportional rope, not {self.rope_type}")
        self._check_scaling_params()
        self._check_factor_lists()
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(int(v) for v in self.mrope_section))
            # Interleaved, the counts only bound each axis's frequencies (transformers applies
            # Qwen3.5's default [11, 11, 10] to any rotary width); in runs they must fill it.
            runs = not self.mrope_interleaved
            if len(self.mrope_section) != 3 or (
                runs and sum(self.mrope_section) != self.rotary_dim // 2
            ):
                raise ValueError(
                    f"mrope_section {list(self.mrope_section)} must be three counts"
                    + (f" summing to rotary_dim // 2 = {self.rotary_dim // 2}" if runs else "")
                )

    def _check_scaling_params(self) -> None:
        if self.rope_type in _NEEDS_ORIGINAL_MAX and not self.original_max_position_embeddings:
            raise ValueError(
                f"{self.rope_type} rope scaling needs original_max_position_embeddings"
            )
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.rope_type == "yarn" and not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(
                "yarn rope scaling needs 0 < beta_slow < beta_fast, got "
                f"{self.beta_slow} and {self.beta_fast}"
            )
        if self.attention_factor is not None:
            if self.rope_type not in ("yarn", "longrope"):
                raise ValueError(
                    f"attention_factor applies to yarn and longrope, not {self.rope_type}"
                )
            if self.attention_factor <= 0:
                raise ValueError(f"rope attention_factor must be > 0, got {self.attention_factor}")

    def _check_factor_lists(self) -> None:
        owners = {"short_factor": "longrope", "long_factor": "longrope", "freq_factors": "default"}
        for name, owner in owners.items():
            value = getattr(self, name)
            if value is None:
                if self.rope_type == owner and owner == "longrope":
                    raise ValueError(f"longrope rope scaling needs {name}")
                continue
            if self.rope_type != owner:
                raise ValueError(f"{name} applies to rope_type {owner!r}, not {self.rope_type!r}")
            if len(value) != self.rotary_dim // 2:
                raise ValueError(
                    f"{name} needs one entry per rotary frequency (rotary_dim // 2 = "
                    f"{self.rotary_dim // 2}), got {len(value)}"
                )
            if min(value) <= 0:
                raise ValueError(f"{name} entries must all be > 0, got {min(value)}")

    def inv_freq(self, long_context: bool = False) -> np.ndarray:  # [rotary_dim // 2] float32
        """The rotation frequencies. ``long_context`` selects longrope's long table (positions at
        or past ``original_max_position_embeddings``); other kinds have a single table."""
        base = rope_scaling.base_inv_freq(self.theta, self.rotary_dim)
        if self.rope_type == "linear":
            return (base / self.factor).astype(np.float32)
        if self.rope_type == "llama3":
            return rope_scaling.llama3_inv_freq(
                base,
                self.factor,
                self.low_freq_factor,
                self.high_freq_factor,
                self.original_max_position_embeddings,
            )
        if self.rope_type == "yarn":
            return rope_scaling.yarn_inv_freq(
                self.theta,
                self.rotary_dim,
                self.factor,
                self.beta_fast,
                self.beta_slow,
                self.original_max_position_embeddings,
                self.truncate,
            )
        if self.rope_type == "proportional":
            turning = int(self.rotated_fraction * self.rotary_dim // 2)
            base[turning:] = 0.0
            return (base / self.factor).astype(np.float32)
        if self.rope_type == "longrope":
            factors = self.long_factor if long_context else self.short_factor
            return rope_scaling.divided_inv_freq(base, factors)
        if self.freq_factors is not None:
            return rope_scaling.divided_inv_freq(base, self.freq_factors)
        return base.astype(np.float32)

    def mrope_axes(self) -> np.ndarray:  # [rotary_dim // 2] int32: 0 (t), 1 (h) or 2 (w)
        """The position axis each frequency turns with. Interleaved (Qwen3-VL): frequency ``j``
        takes h when ``j % 3 == 1`` and ``j < 3 * section[1]``, w when ``j % 3 == 2`` and ``j <
        3 * section[2]``, else t; otherwise the first ``section[0]`` take t, the next h, the
        rest w."""
        t, h, w = self.mrope_section
        j = np.arange(self.rotary_dim // 2)
        if self.mrope_interleaved:
            axes = np.zeros_like(j)
            axes[(j % 3 == 1) & (j < 3 * h)] = 1
            axes[(j % 3 == 2) & (j < 3 * w)] = 2
            return axes.astype(np.int32)
        return np.repeat(np.arange(3), (t, h, w)).astype(np.int32)

    @property
    def attention_scale(self) -> float:
        """The gain on cos and sin: ``attention_factor`` when set, else yarn's
        ``0.1 * ln(factor) + 1``, longrope's ``sqrt(1 + ln(factor) / ln(original_max))``, or 1."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.rope_type == "yarn":
            return rope_scaling.yarn_mscale(self.factor)
        if self.rope_type == "longrope":
            return rope_scaling.longrope_attention_factor(
                self.factor, self.original_max_position_embeddings
            )
        return 1.0


def rope_from_hf(hf: dict[str, Any], rotary_dim: int) -> RopeConfig:
    """Rope settings from an HF config dict: ``rope_parameters`` (transformers 5) or the older
    top-level ``rope_theta`` plus ``rope_scaling`` dict (whose kind may be keyed ``type``).

    Missing values are derived as transformers does: ``original_max_position_embeddings`` from the
    top level (Phi-3 keeps it there), else the rope dict, else ``max_position_embeddings``; a
    missing yarn/longrope ``factor`` is ``max_position_embeddings / original``; DeepSeek's
    ``mscale`` / ``mscale_all_dim`` pair sets yarn's attention factor. ``rope_freq_factors`` (not
    an HF key: the GGUF loader puts a Llama 3 file's ``rope_freqs`` there) divides the default
    frequencies. ``interleaved`` is left to the architecture.
    """
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = LEGACY_ROPE_TYPES.get(rope_type, rope_type)
    if rope_type == "default" or rope_type not in ROPE_TYPES:
        # Unknown kinds are rejected by the config, with the list of supported ones.
        # GGUF files for Llama 3 carry precomputed per-frequency divisors instead of parameters.
        factors = hf.get("rope_freq_factors")
        return RopeConfig(
            theta=theta,
            rotary_dim=rotary_dim,
            rope_type=rope_type,
            freq_factors=None if factors is None else tuple(float(f) for f in factors),
        )
    original = None
    if rope_type in _NEEDS_ORIGINAL_MAX:
        original = (
            hf.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings")
        )
    common = dict(
        theta=theta,
        rotary_dim=rotary_dim,
        rope_type=rope_type,
        original_max_position_embeddings=None if original is None else int(original),
    )
    if rope_type == "yarn":
        return _yarn_from_hf(hf, params, common)
    if rope_type == "longrope":
        return RopeConfig(
            **common,
            factor=_extension_factor(hf, params, common),
            short_factor=params.get("short_factor"),
            long_factor=params.get("long_factor"),
            attention_factor=params.get("attention_factor"),
        )
    if rope_type == "proportional":
        return RopeConfig(
            **common,
            factor=float(params.get("factor", 1.0)),
            rotated_fraction=float(params.get("partial_rotary_factor", 1.0)),
        )
    return RopeConfig(
        **common,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
    )


def _extension_factor(hf: dict[str, Any], params: dict[str, Any], common: dict[str, Any]) -> float:
    """The rope dict's ``factor``, or the context extension ratio when it has none."""
    if params.get("factor") is not None:
        return float(params["factor"])
    original = common["original_max_position_embeddings"]
    if not hf.get("max_position_embeddings") or not original:
        raise ValueError(
            f"{common['rope_type']} rope scaling needs a factor, or max_position_embeddings and "
            "original_max_position_embeddings to derive it"
        )
    return hf["max_position_embeddings"] / original


def _yarn_from_hf(hf: dict[str, Any], params: dict[str, Any], common: dict[str, Any]) -> RopeConfig:
    factor = _extension_factor(hf, params, common)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = rope_scaling.yarn_mscale(factor, mscale) / rope_scaling.yarn_mscale(
            factor, mscale_all_dim
        )
    return RopeConfig(
        **common,
        factor=factor,
        # Zero or null betas mean the paper's defaults, as in transformers.
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def _rotation_angles(
    positions: jax.Array,  # [..., seq] int32, or [..., seq, 3] (t, h, w) under mrope
    rope: RopeConfig,
    mrope: bool = False,
) -> jax.Array:  # [..., seq, rotary_dim // 2] float32
    if mrope:  # each frequency's own axis of the token's three positions
        pos = jnp.take(positions, jnp.asarray(rope.mrope_axes()), axis=-1).astype(jnp.float32)
        return pos * jnp.asarray(rope.inv_freq())
    pos = positions.astype(jnp.float32)[..., None]
    angles = pos * jnp.asarray(rope.inv_freq())
    if rope.rope_type == "longrope":
        long_angles = pos * jnp.asarray(rope.inv_freq(long_context=True))
        is_long = positions[..., None] >= rope.original_max_position_embeddings
        angles = jnp.where(is_long, long_angles, angles)
    return angles


def apply_rope(
    x: jax.Array,  # [..., seq, num_heads, head_dim]
    positions: jax.Array,  # [..., seq] int32, or [..., seq, 3] under mrope
    rope: RopeConfig,
) -> jax.Array:  # [..., seq, num_heads, head_dim], x.dtype
    """Rotate the first ``rotary_dim`` features of every head by its token's position; the rest
    pass through. Rotation and the ``attention_scale`` gain are computed in float32. A config
    with ``mrope_section`` takes three positions per token (plain positions are three equal
    ones)."""
    mrope = rope.mrope_section is not None and positions.ndim == x.ndim - 1
    angles = _rotation_angles(positions, rope, mrope)[..., None, :]  # [..., seq, 1, rot // 2]
    scale = rope.attention_scale
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    rot, rest = x[..., : rope.rotary_dim].astype(jnp.float32), x[..., rope.rotary_dim :]
    if rope.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        pairs = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        rotated = pairs.reshape(rot.shape)
    else:
        half = rope.rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), rest], axis=-1)
