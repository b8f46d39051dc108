"""The Qwen3-VL vision tower (``Qwen3VLVisionModel``) as ``flax.nnx`` modules: patches of
``temporal_patch_size`` frames embedded by a linear map with bias (HF's stride-patch Conv3d),
plus a learned position table resampled bilinearly to each image's patch grid; pre-norm
LayerNorm blocks whose attention rotates queries and keys by each patch's 2D position (axial
RoPE: the first half of the rotated pairs turns with the patch's row, the second with its
column) and whose MLP is plain; then the patch merger (LayerNorm, each ``merge x merge`` window's
patch vectors concatenated, linear-GELU-linear to the text model's width), and after each block
of ``deepstack_visual_indexes`` a *deepstack* merger of that block's output (its LayerNorm over
the concatenation), whose tokens the decoder adds to the image rows after its early layers.

Images go through one call *packed*, as in ``models.vision.pixtral``: every image's patches in a
flat run, each with its (row, column, image rows, image columns) in patches and its image's
index (``segments``); a patch attends only to its own image (HF's per-frame ``cu_seqlens``, one
frame per image here) and padding patches (segment -1) are seen by none. Each image's run must
group every merge window's ``merge**2`` patches together (row by row within it), as HF's image
processor orders them, so the mergers are reshapes of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_llm_runtime.models.layers.mlp import ACTIVATIONS, check_activation
from jax_llm_runtime.models.vision.attention import packed_attention

NORM_EPS = 1e-6  # every LayerNorm of HF's tower and mergers, whatever the config says


@dataclass(frozen=True)
class Qwen3VLTowerConfig:
    """The tower's shape, from an HF ``Qwen3VLVisionConfig`` (``qwen3_vl_tower_config_from_hf``)."""

    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    in_channels: int = 3
    rope_theta: float = 10_000.0
    activation: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        for name in (
            "hidden_size", "intermediate_size", "depth", "num_heads", "patch_size",
            "temporal_patch_size", "spatial_merge_size", "out_hidden_size",
            "num_position_embeddings", "in_channels",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"vision {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % (4 * self.num_heads):
            raise ValueError(
                f"vision hidden_size {self.hidden_size} over {self.num_heads} heads does not give "
                "a head_dim divisible by 4 (2D RoPE)"
            )
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(
                f"vision num_position_embeddings {self.num_position_embeddings} is not a square "
                "(the position table is a square grid)"
            )
        levels = self.deepstack_visual_indexes
        # HF emits the deepstack levels in block order: increasing indexes keep it the config's.
        if list(levels) != sorted(set(levels)) or not all(0 <= i < self.depth for i in levels):
            raise ValueError(
                f"deepstack_visual_indexes {list(levels)} must be increasing block indexes "
                f"below depth {self.depth}"
            )
        check_activation(self.activation)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_features(self) -> int:
        """Features of one flattened patch: ``(channel, frame, row, column)`` order."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_size(self) -> int:
        """Width of a merge window's concatenated patch vectors."""
        return self.hidden_size * self.spatial_merge_size**2


def _integer(hf: dict[str, Any], key: str, default: int) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int):
        raise ValueError(f"vision_config.{key} must be one integer, got {value!r}")
    return value


def qwen3_vl_tower_config_from_hf(hf: dict[str, Any]) -> Qwen3VLTowerConfig:
    """An HF Qwen3-VL ``vision_config`` dict (``rope_parameters`` of transformers 5, or none:
    the fixed theta of 10,000 that older configs imply)."""
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope_type {rope['rope_type']!r} is not supported (axial is)")
    return Qwen3VLTowerConfig(
        hidden_size=int(hf.get("hidden_size", 1152)),
        intermediate_size=int(hf.get("intermediate_size", 4304)),
        depth=int(hf.get("depth", 27)),
        num_heads=int(hf.get("num_heads", 16)),
        patch_size=_integer(hf, "patch_size", 16),
        temporal_patch_size=_integer(hf, "temporal_patch_size", 2),
        spatial_merge_size=int(hf.get("spatial_merge_size", 2)),
        out_hidden_size=int(hf.get("out_hidden_size", 3584)),
        num_position_embeddings=int(hf.get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=tuple(
            int(i) for i in hf.get("deepstack_visual_indexes", (8, 16, 24))
        ),
        in_channels=int(hf.get("in_channels", 3)),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        activation=hf.get("hidden_act", "gelu_pytorch_tanh"),
    )


def _param(shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    # Zeros: every value is replaced from the checkpoint (models.vision.encoder.load_vision).
    return nnx.Param(jnp.zeros(shape, dtype))


class Dense(nnx.Module):
    """``x @ kernel + bias``; ``kernel`` is ``[in, out]`` (HF's ``weight`` transposed)."""

    def __init__(self, features: tuple[int, int], dtype: jnp.dtype) -> None:
        self.kernel = _param(features, dtype)
        self.bias = _param((features[1],), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        return x @ self.kernel.get_value() + self.bias.get_value()


class LayerNorm(nnx.Module):
    """LayerNorm with ``weight`` and ``bias`` (eps 1e-6), computed in float32."""

    def __init__(self, dim: int, dtype: jnp.dtype) -> None:
        self.weight = _param((dim,), dtype)
        self.bias = _param((dim,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim]
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + NORM_EPS)
        return (h * self.weight.get_value() + self.bias.get_value()).astype(x.dtype)


def _axis_taps(
    index: jax.Array, size: jax.Array, side: int
) -> tuple[jax.Array, jax.Array, jax.Array]:  # low, high [p] int32; fraction [p] float32
    """The two table rows (or columns) that patch ``index`` of an axis of ``size`` patches
    mixes, at ``linspace(0, side - 1, size)[index]`` (align-corners), and the weight of the
    second."""
    src = index.astype(jnp.float32) * (side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
    floor = jnp.floor(src)
    low = floor.astype(jnp.int32)
    return low, jnp.minimum(low + 1, side - 1), src - floor


def interpolated_positions(
    table: jax.Array,  # [side * side, hidden]
    positions: jax.Array,  # [num_patches, 4] int32: (row, column, rows, columns)
) -> jax.Array:  # [num_patches, hidden] float32
    """The learned position table resampled bilinearly to each patch's image grid: the mix of
    its four nearest table entries."""
    side = math.isqrt(table.shape[0])
    row0, row1, fr = _axis_taps(positions[:, 0], positions[:, 2], side)
    col0, col1, fc = _axis_taps(positions[:, 1], positions[:, 3], side)
    taps = (
        (row0, col0, (1 - fr) * (1 - fc)),
        (row0, col1, (1 - fr) * fc),
        (row1, col0, fr * (1 - fc)),
        (row1, col1, fr * fc),
    )
    out = jnp.zeros((positions.shape[0], table.shape[1]), jnp.float32)
    for rows, cols, weight in taps:
        out = out + table[rows * side + cols].astype(jnp.float32) * weight[:, None]
    return out


def rope_tables(
    cfg: Qwen3VLTowerConfig,
    positions: jax.Array,  # [num_patches, 4] int32: (row, column, ...)
) -> tuple[jax.Array, jax.Array]:  # cos, sin: [num_patches, head_dim] float32
    """2D RoPE: ``head_dim / 4`` frequencies; the first quarter of the angles turns with the
    row, the second with the column, laid out twice for ``rotate_half``."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half)
    rows = positions[:, :1].astype(jnp.float32) * inv_freq
    cols = positions[:, 1:2].astype(jnp.float32) * inv_freq
    angles = jnp.concatenate([rows, cols, rows, cols], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` in float32 (as HF), back in ``x``'s dtype; x
    ``[heads, p, head_dim]``."""
    h = x.astype(jnp.float32)
    half = h.shape[-1] // 2
    rotated = jnp.concatenate([-h[..., half:], h[..., :half]], axis=-1)
    return (h * cos + rotated * sin).astype(x.dtype)


class Qwen3VLBlock(nnx.Module):
    """One block: x + attn(norm1(x)) over the patches of each image, then x + mlp(norm2(x))."""

    def __init__(self, cfg: Qwen3VLTowerConfig, dtype: jnp.dtype) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.cfg = cfg
        self.norm1, self.norm2 = LayerNorm(d, dtype), LayerNorm(d, dtype)
        self.qkv, self.proj = Dense((d, 3 * d), dtype), Dense((d, d), dtype)
        self.linear_fc1, self.linear_fc2 = Dense((d, f), dtype), Dense((f, d), dtype)

    def __call__(
        self,
        x: jax.Array,  # [num_patches, hidden]
        rope: tuple[jax.Array, jax.Array],  # cos, sin: [num_patches, head_dim]
        visible: jax.Array,  # [num_patches, num_patches] bool: query row sees key column
    ) -> jax.Array:  # [num_patches, hidden]
        cfg = self.cfg
        p = x.shape[0]
        # HF splits the fused projection as [3, heads, head_dim]: queries, keys, values.
        qkv = self.qkv(self.norm1(x)).reshape(p, 3, cfg.num_heads, cfg.head_dim)
        q, k, v = qkv.transpose(1, 2, 0, 3)  # each [heads, p, head_dim]
        q, k = _rotate(q, *rope), _rotate(k, *rope)

        attn = packed_attention(q, k, v, visible)
        x = x + self.proj(attn)
        act = ACTIVATIONS[cfg.activation]
        return x + self.linear_fc2(act(self.linear_fc1(self.norm2(x))))


class Qwen3VLMerger(nnx.Module):
    """Patch vectors ``[num_patches, hidden]`` (merge windows together) to tokens
    ``[num_patches / merge**2, out_hidden]``: each window's vectors concatenated patch after
    patch, normed per patch (the main merger) or over the concatenation (``postshuffle``, the
    deepstack mergers), then linear, exact GELU, linear."""

    def __init__(self, cfg: Qwen3VLTowerConfig, postshuffle: bool, dtype: jnp.dtype) -> None:
        merged = cfg.merged_size
        self.merged, self.postshuffle = merged, postshuffle
        self.norm = LayerNorm(merged if postshuffle else cfg.hidden_size, dtype)
        self.linear_fc1 = Dense((merged, merged), dtype)
        self.linear_fc2 = Dense((merged, cfg.out_hidden_size), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.reshape(-1, self.merged) if self.postshuffle else x
        h = self.norm(h).reshape(-1, self.merged)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(h), approximate=False))


class Qwen3VLVisionTower(nnx.Module):
    """Packed patches ``[num_patches, patch_features]`` to the image tokens and each deepstack
    level's, side by side: ``[num_patches / merge**2, (1 + levels) * out_hidden]``."""

    def __init__(self, cfg: Qwen3VLTowerConfig, dtype: jnp.dtype) -> None:
        self.cfg = cfg
        self.patch_embed = Dense((cfg.patch_features, cfg.hidden_size), dtype)
        self.pos_embed = _param((cfg.num_position_embeddings, cfg.hidden_size), dtype)
        self.blocks = nnx.List([Qwen3VLBlock(cfg, dtype) for _ in range(cfg.depth)])
        self.merger = Qwen3VLMerger(cfg, False, dtype)
        self.deepstack_mergers = nnx.List(
            [Qwen3VLMerger(cfg, True, dtype) for _ in cfg.deepstack_visual_indexes]
        )

    def __call__(
        self,
        patches: jax.Array,  # [num_patches, patch_features], (channel, frame, row, col) order
        positions: jax.Array,  # [num_patches, 4] int32: (row, column, rows, columns) in patches
        segments: jax.Array,  # [num_patches] int32: its image's index in the call; -1: padding
    ) -> jax.Array:  # [num_patches / merge**2, (1 + levels) * out_hidden]
        cfg = self.cfg
        x = self.patch_embed(patches.astype(self.patch_embed.kernel.dtype))
        x = x + interpolated_positions(self.pos_embed.get_value(), positions).astype(x.dtype)
        rope = rope_tables(cfg, positions)
        visible = (segments[:, None] == segments[None, :]) & (segments[None, :] >= 0)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, visible)
            if i in cfg.deepstack_visual_indexes:
                merger = self.deepstack_mergers[cfg.deepstack_visual_indexes.index(i)]
                levels.append(merger(x))
        return jnp.concatenate([self.merger(x), *levels], axis=-1)


def qwen3_vl_checkpoint_names(cfg: Qwen3VLTowerConfig, prefix: str) -> dict[str, tuple[Any, ...]]:
    """HF tensor name (under ``prefix``, e.g. ``model.visual.``) -> the parameter's path in
    ``Qwen3VLVisionTower``'s state, for every parameter."""
    names: dict[str, tuple[Any, ...]] = {
        "patch_embed.proj.weight": ("patch_embed", "kernel"),
        "patch_embed.proj.bias": ("patch_embed", "bias"),
        "pos_embed.weight": ("pos_embed",),
    }
    block = {
        "norm1": "norm1", "norm2": "norm2", "attn.qkv": "qkv", "attn.proj": "proj",
        "mlp.linear_fc1": "linear_fc1", "mlp.linear_fc2": "linear_fc2",
    }  # fmt: skip
    merger = ("norm", "linear_fc1", "linear_fc2")

    def add(hf: str, path: tuple[Any, ...], norm: bool) -> None:
        names[f"{hf}.weight"] = (*path, "weight" if norm else "kernel")
        names[f"{hf}.bias"] = (*path, "bias")

    for i in range(cfg.depth):
        for hf_name, ours in block.items():
            add(f"blocks.{i}.{hf_name}", ("blocks", i, ours), ours.startswith("norm"))
    for name in merger:
        add(f"merger.{name}", ("merger", name), name == "norm")
    for j in range(len(cfg.deepstack_visual_indexes)):
        for name in merger:
            add(f"deepstack_merger_list.{j}.{name}", ("deepstack_mergers", j, name), name == "norm")
    return {prefix + name: path for name, path in names.items()}
