"""The SigLIP vision tower (``SiglipVisionModel`` without its pooling head) as ``flax.nnx``
modules: patches embedded by a linear map (HF's stride-``patch_size`` convolution), learned
position embeddings, pre-norm encoder layers with bidirectional attention over all patches,
and a final LayerNorm. Its output is ``last_hidden_state``: one vector per patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_llm_runtime.models.layers.mlp import ACTIVATIONS, check_activation


@dataclass(frozen=True)
class SiglipConfig:
    """The vision tower's shape, from an HF ``SiglipVisionConfig`` (``siglip_config_from_hf``)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    activation: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "patch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"vision {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} is not a multiple of its "
                f"{self.num_heads} heads"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision image_size {self.image_size} is not a multiple of patch_size "
                f"{self.patch_size}"
            )
        check_activation(self.activation)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2


def siglip_config_from_hf(hf: dict[str, Any]) -> SiglipConfig:
    """An HF ``vision_config`` dict (a square image size; no pooling head is used)."""
    image_size, patch_size = hf.get("image_size", 224), hf.get("patch_size", 16)
    for name, value in (("image_size", image_size), ("patch_size", patch_size)):
        if not isinstance(value, int):
            raise ValueError(f"vision_config.{name} must be one integer, got {value!r}")
    return SiglipConfig(
        hidden_size=int(hf.get("hidden_size", 768)),
        intermediate_size=int(hf.get("intermediate_size", 3072)),
        num_layers=int(hf.get("num_hidden_layers", 12)),
        num_heads=int(hf.get("num_attention_heads", 12)),
        image_size=image_size,
        patch_size=patch_size,
        num_channels=int(hf.get("num_channels", 3)),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-6)),
        activation=hf.get("hidden_act", "gelu_pytorch_tanh"),
    )


def _param(shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    # Zeros: every value is replaced from the checkpoint (models.vision.loading checks that).
    return nnx.Param(jnp.zeros(shape, dtype))


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias, computed in float32."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.eps = eps
        self.weight, self.bias = _param((dim,), dtype), _param((dim,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim]
        h = x.astype(jnp.float32)
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.weight.get_value() + self.bias.get_value()).astype(x.dtype)


class Dense(nnx.Module):
    """``x @ kernel + bias``; ``kernel`` is ``[in, out]`` (HF's ``weight`` transposed)."""

    def __init__(self, features: tuple[int, int], dtype: jnp.dtype) -> None:
        self.kernel, self.bias = _param(features, dtype), _param((features[1],), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        return x @ self.kernel.get_value() + self.bias.get_value()


class SiglipLayer(nnx.Module):
    """One encoder layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: SiglipConfig, dtype: jnp.dtype) -> None:
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.cfg = cfg
        self.layer_norm1, self.layer_norm2 = LayerNorm(d, eps, dtype), LayerNorm(d, eps, dtype)
        self.q_proj, self.k_proj = Dense((d, d), dtype), Dense((d, d), dtype)
        self.v_proj, self.out_proj = Dense((d, d), dtype), Dense((d, d), dtype)
        self.fc1 = Dense((d, cfg.intermediate_size), dtype)
        self.fc2 = Dense((cfg.intermediate_size, d), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [num_images, num_patches, hidden]
        cfg = self.cfg
        n, p, d = x.shape
        head_dim = d // cfg.num_heads
        h = self.layer_norm1(x)

        def heads(y: jax.Array) -> jax.Array:  # [n, heads, p, head_dim]
            return y.reshape(n, p, cfg.num_heads, head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))

        def one_head(qkv: tuple[jax.Array, ...]) -> jax.Array:  # [n, p, head_dim]
            q, k, v = qkv
            scores = jnp.einsum("nqd,nkd->nqk", q, k, preferred_element_type=jnp.float32)
            probs = jax.nn.softmax(scores * head_dim**-0.5, axis=-1).astype(v.dtype)
            return jnp.einsum("nqk,nkd->nqd", probs, v)

        # A head at a time: Gemma 3's 4096 patches make one head's scores 64 MB per image, all
        # 16 heads' a gigabyte.
        per_head = jax.lax.map(one_head, tuple(t.transpose(1, 0, 2, 3) for t in (q, k, v)))
        attn = per_head.transpose(1, 2, 0, 3).reshape(n, p, d)  # [n, p, heads * head_dim]
        x = x + self.out_proj(attn)
        h = self.fc2(ACTIVATIONS[cfg.activation](self.fc1(self.layer_norm2(x))))
        return x + h


class SiglipVisionTower(nnx.Module):
    """Pixels ``[num_images, channels, image_size, image_size]`` to patch vectors
    ``[num_images, num_patches, hidden]``."""

    def __init__(self, cfg: SiglipConfig, dtype: jnp.dtype) -> None:
        self.cfg = cfg
        patch_features = cfg.num_channels * cfg.patch_size**2
        self.patch_embedding = Dense((patch_features, cfg.hidden_size), dtype)
        self.position_embedding = _param((cfg.num_patches, cfg.hidden_size), dtype)
        self.layers = nnx.List([SiglipLayer(cfg, dtype) for _ in range(cfg.num_layers)])
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def __call__(
        self,
        pixels: jax.Array,  # [num_images, channels, image_size, image_size]
    ) -> jax.Array:  # [num_images, num_patches, hidden]
        cfg = self.cfg
        n, c, side, p = pixels.shape[0], cfg.num_channels, cfg.patches_per_side, cfg.patch_size
        # Each patch's pixels in the convolution weight's (channel, row, column) order; patches
        # row by row, as HF flattens the convolution's output grid.
        patches = pixels.reshape(n, c, side, p, side, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(n, side * side, c * p * p).astype(
            self.patch_embedding.kernel.dtype
        )
        x = self.patch_embedding(patches) + self.position_embedding.get_value()
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


def siglip_checkpoint_names(cfg: SiglipConfig, prefix: str) -> dict[str, tuple[Any, ...]]:
    """HF tensor name (under ``prefix``, e.g. ``model.vision_tower.vision_model.``) -> the
    parameter's path in ``SiglipVisionTower``'s state, for every parameter."""
    names: dict[str, tuple[Any, ...]] = {
        "embeddings.patch_embedding.weight": ("patch_embedding", "kernel"),
        "embeddings.patch_embedding.bias": ("patch_embedding", "bias"),
        "embeddings.position_embedding.weight": ("position_embedding",),
        "post_layernorm.weight": ("post_layernorm", "weight"),
        "post_layernorm.bias": ("post_layernorm", "bias"),
    }
    modules = {
        "layer_norm1": "layer_norm1", "layer_norm2": "layer_norm2", "self_attn.q_proj": "q_proj",
        "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
        "self_attn.out_proj": "out_proj", "mlp.fc1": "fc1", "mlp.fc2": "fc2",
    }  # fmt: skip
    for i in range(cfg.num_layers):
        for hf_name, ours in modules.items():
            kind = "weight" if ours.startswith("layer_norm") else "kernel"
            names[f"encoder.layers.{i}.{hf_name}.weight"] = ("layers", i, ours, kind)
            names[f"encoder.layers.{i}.{hf_name}.bias"] = ("layers", i, ours, "bias")
    return {prefix + name: path for name, path in names.items()}
