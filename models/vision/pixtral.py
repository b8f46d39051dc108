"""The Pixtral vision tower (``PixtralVisionModel``) as ``flax.nnx`` modules: patches embedded by
a linear map (HF's stride-``patch_size`` convolution without bias), an RMSNorm (``ln_pre``),
then pre-norm layers whose attention rotates queries and keys by each patch's 2D position
(axial RoPE: half the rotated pairs turn with the patch's row, half with its column) and whose
MLP is gated. There is no final norm.

Images of any size go through one call *packed*: the patches of every image in a flat run,
each with its (row, column) in its image and the index of its image (``segments``); a patch
attends only to the patches of its own image, as HF's block-diagonal mask over several images
has it, and padding patches (segment -1) are seen by none. Attention is permutation-equivariant
given the positions, so the run may order an image's patches as its caller needs
(``models.families.mistral3_vision`` groups each merge window's patches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_llm_runtime.models.layers.mlp import ACTIVATIONS, check_activation
from jax_llm_runtime.models.vision.attention import packed_attention

RMS_EPS = 1e-5  # PixtralRMSNorm's eps in every norm of the tower, whatever the config says


@dataclass(frozen=True)
class PixtralConfig:
    """The vision tower's shape, from an HF ``PixtralVisionConfig`` (``pixtral_config_from_hf``)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    num_channels: int = 3
    rope_theta: float = 10_000.0
    activation: str = "gelu"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "patch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"vision {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % (4 * self.num_heads):
            raise ValueError(
                f"vision hidden_size {self.hidden_size} over {self.num_heads} heads does not give "
                "a head_dim divisible by 4 (2D RoPE)"
            )
        check_activation(self.activation)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_features(self) -> int:
        return self.num_channels * self.patch_size**2


def pixtral_config_from_hf(hf: dict[str, Any]) -> PixtralConfig:
    """An HF Pixtral ``vision_config`` dict (``rope_parameters`` or the older ``rope_theta``)."""
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ValueError(f"vision rope_type {rope['rope_type']!r} is not supported (axial is)")
    patch_size = hf.get("patch_size", 16)
    if not isinstance(patch_size, int):
        raise ValueError(f"vision_config.patch_size must be one integer, got {patch_size!r}")
    return PixtralConfig(
        hidden_size=int(hf.get("hidden_size", 1024)),
        intermediate_size=int(hf.get("intermediate_size", 4096)),
        num_layers=int(hf.get("num_hidden_layers", 24)),
        num_heads=int(hf.get("num_attention_heads", 16)),
        patch_size=patch_size,
        num_channels=int(hf.get("num_channels", 3)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        activation=hf.get("hidden_act", "gelu"),
    )


def _param(shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    # Zeros: every value is replaced from the checkpoint (models.vision.encoder.load_vision).
    return nnx.Param(jnp.zeros(shape, dtype))


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled by ``weight`` in the input's dtype (as HF's)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.eps = eps
        self.weight = _param((dim,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim]
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight.get_value() * h.astype(x.dtype)


class Linear(nnx.Module):
    """``x @ kernel``; ``kernel`` is ``[in, out]`` (HF's ``weight`` transposed)."""

    def __init__(self, features: tuple[int, int], dtype: jnp.dtype) -> None:
        self.kernel = _param(features, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        return x @ self.kernel.get_value()


def rope_tables(
    cfg: PixtralConfig,
    positions: jax.Array,  # [num_patches, 2] int32: each patch's (row, column)
) -> tuple[jax.Array, jax.Array]:  # cos, sin: [num_patches, head_dim] float32
    """2D RoPE: of the ``head_dim / 2`` frequencies, the even ones turn with the row and the odd
    ones with the column; the angles are laid out for ``rotate_half``."""
    dim = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    rows = positions[:, :1].astype(jnp.float32) * inv_freq[0::2]
    cols = positions[:, 1:].astype(jnp.float32) * inv_freq[1::2]
    angles = jnp.concatenate([rows, cols, rows, cols], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` over the last axis; x ``[heads, p, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


class PixtralLayer(nnx.Module):
    """One layer: x + attn(norm(x)) over the patches of each image, then x + mlp(norm(x))."""

    def __init__(self, cfg: PixtralConfig, dtype: jnp.dtype) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.cfg = cfg
        self.attention_norm, self.ffn_norm = RMSNorm(d, RMS_EPS, dtype), RMSNorm(d, RMS_EPS, dtype)
        self.q_proj, self.k_proj = Linear((d, d), dtype), Linear((d, d), dtype)
        self.v_proj, self.o_proj = Linear((d, d), dtype), Linear((d, d), dtype)
        self.gate_proj, self.up_proj = Linear((d, f), dtype), Linear((d, f), dtype)
        self.down_proj = Linear((f, d), dtype)

    def __call__(
        self,
        x: jax.Array,  # [num_patches, hidden]
        rope: tuple[jax.Array, jax.Array],  # cos, sin: [num_patches, head_dim]
        visible: jax.Array,  # [num_patches, num_patches] bool: query row sees key column
    ) -> jax.Array:  # [num_patches, hidden]
        cfg = self.cfg
        p = x.shape[0]
        h = self.attention_norm(x)

        def heads(y: jax.Array) -> jax.Array:  # [heads, p, head_dim]
            return y.reshape(p, cfg.num_heads, cfg.head_dim).transpose(1, 0, 2)

        q = _rotate(heads(self.q_proj(h)), *rope)
        k = _rotate(heads(self.k_proj(h)), *rope)
        v = heads(self.v_proj(h))

        attn = packed_attention(q, k, v, visible)
        x = x + self.o_proj(attn)
        h = self.ffn_norm(x)
        act = ACTIVATIONS[cfg.activation]
        return x + self.down_proj(act(self.gate_proj(h)) * self.up_proj(h))


class PixtralVisionTower(nnx.Module):
    """Packed patches ``[num_patches, channels * patch_size**2]`` to patch vectors
    ``[num_patches, hidden]`` (the last layer's output)."""

    def __init__(self, cfg: PixtralConfig, dtype: jnp.dtype) -> None:
        self.cfg = cfg
        self.patch_conv = Linear((cfg.patch_features, cfg.hidden_size), dtype)
        self.ln_pre = RMSNorm(cfg.hidden_size, RMS_EPS, dtype)
        self.layers = nnx.List([PixtralLayer(cfg, dtype) for _ in range(cfg.num_layers)])

    def __call__(
        self,
        patches: jax.Array,  # [num_patches, channels * patch_size**2], (channel, row, col) order
        positions: jax.Array,  # [num_patches, 2] int32: (row, column) in its image
        segments: jax.Array,  # [num_patches] int32: its image's index in the call; -1: padding
    ) -> jax.Array:  # [num_patches, hidden]
        x = self.ln_pre(self.patch_conv(patches.astype(self.patch_conv.kernel.dtype)))
        rope = rope_tables(self.cfg, positions)
        visible = (segments[:, None] == segments[None, :]) & (segments[None, :] >= 0)
        for layer in self.layers:
            x = layer(x, rope, visible)
        return x


def pixtral_checkpoint_names(cfg: PixtralConfig, prefix: str) -> dict[str, tuple[Any, ...]]:
    """HF tensor name (under ``prefix``, e.g. ``model.vision_tower.``) -> the parameter's path
    in ``PixtralVisionTower``'s state, for every parameter."""
    names: dict[str, tuple[Any, ...]] = {
        "patch_conv.weight": ("patch_conv", "kernel"),
        "ln_pre.weight": ("ln_pre", "weight"),
    }
    modules = {
        "attention_norm": "attention_norm", "ffn_norm": "ffn_norm",
        "attention.q_proj": "q_proj", "attention.k_proj": "k_proj",
        "attention.v_proj": "v_proj", "attention.o_proj": "o_proj",
        "feed_forward.gate_proj": "gate_proj", "feed_forward.up_proj": "up_proj",
        "feed_forward.down_proj": "down_proj",
    }  # fmt: skip
    for i in range(cfg.num_layers):
        for hf_name, ours in modules.items():
            kind = "weight" if ours.endswith("_norm") else "kernel"
            names[f"transformer.layers.{i}.{hf_name}.weight"] = ("layers", i, ours, kind)
    return {prefix + name: path for name, path in names.items()}
