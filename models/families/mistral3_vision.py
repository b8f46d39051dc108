"""Mistral 3's image encoder: the Pixtral tower over images of any size, then the multimodal
projector (an RMSNorm, the patch merger that concatenates each ``spatial_merge_size`` square of
patch vectors and maps it back to the tower's width, and a linear-GELU-linear to the text
model's width). Its output replaces the embeddings of the prompt's ``[IMG]`` tokens, one per
merged patch, row by row (the ``[IMG_BREAK]`` and ``[IMG_END]`` tokens between the rows keep
their own embeddings); the decoder (``models.families.mistral``) attends over them causally,
as over text.

Images enter the tower packed (``models.vision.encoder.PackedImages``): each image's patches in
the order of its merged tokens, each merge window's ``spatial_merge_size**2`` patches together,
so the merger is a reshape of the run.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_llm_runtime.models import checkpoint
from jax_llm_runtime.models.layers.mlp import ACTIVATIONS, check_activation
from jax_llm_runtime.models.vision.encoder import (
    PackedImages,
    VisionSpec,
    VisionWeights,
    load_vision,
    pack_images,
)
from jax_llm_runtime.models.vision.pixtral import (
    PixtralConfig,
    PixtralVisionTower,
    RMSNorm,
    pixtral_checkpoint_names,
    pixtral_config_from_hf,
)

VISION_PREFIX = "model.vision_tower."
PROJECTOR_PREFIX = "model.multi_modal_projector."


def canonical_name(name: str) -> str:
    """A Mistral 3 checkpoint name in one spelling: checkpoints on the Hub (and
    ``save_pretrained`` of transformers 5) write ``language_model.model.*``,
    ``language_model.lm_head.*``, ``vision_tower.*`` and ``multi_modal_projector.*``; others
    write them under ``model.``. The text model's rules read ``model.language_model.*``."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith(("vision_tower.", "multi_modal_projector.")):
        return "model." + name
    return name


# The text model of the checkpoint (names made canonical; the encoder's are skipped).
load_text = functools.partial(checkpoint.load_renamed, canonical_name)


@dataclass(frozen=True)
class Mistral3VisionConfig:
    """The encoder's shape and the prompt token that carries its output."""

    tower: PixtralConfig
    text_hidden_size: int
    spatial_merge_size: int
    image_token_id: int  # [IMG]: one per merged patch
    projector_activation: str = "gelu"
    projector_bias: bool = False
    norm_eps: float = 1e-5  # the text model's rms_norm_eps, as HF's projector takes it

    def __post_init__(self) -> None:
        if self.spatial_merge_size < 1:
            raise ValueError(f"spatial_merge_size must be >= 1, got {self.spatial_merge_size}")
        check_activation(self.projector_activation)

    @property
    def patch_size(self) -> int:
        return self.tower.patch_size

    @property
    def patch_features(self) -> int:
        """Values per packed patch (``PackedImages.patches``)."""
        return self.tower.patch_features

    @property
    def position_width(self) -> int:
        """Values per patch position (``PackedImages.positions``): row and column."""
        return 2

    @property
    def patch_multiple(self) -> int:
        """Patches per merged token: every packed run is a multiple of it."""
        return self.spatial_merge_size**2

    def num_patches(self, height: int, width: int) -> int:
        """Patches of a ``height x width`` image (each side a multiple of patch * merge)."""
        return (height // self.patch_size) * (width // self.patch_size)


def mistral3_vision_config_from_hf(hf: dict[str, Any]) -> Mistral3VisionConfig:
    """The encoder of an HF ``Mistral3ForConditionalGeneration`` config."""
    text = hf.get("text_config") or {}
    layer = hf.get("vision_feature_layer", -1)
    if layer != -1:
        raise ValueError(f"vision_feature_layer {layer!r} is not supported (-1, the last, is)")
    return Mistral3VisionConfig(
        tower=pixtral_config_from_hf(hf.get("vision_config") or {}),
        text_hidden_size=int(text.get("hidden_size", 5120)),
        spatial_merge_size=int(hf.get("spatial_merge_size", 2)),
        image_token_id=int(hf.get("image_token_id", hf.get("image_token_index", 10))),
        projector_activation=hf.get("projector_hidden_act", "gelu"),
        projector_bias=bool(hf.get("multimodal_projector_bias", False)),
        norm_eps=float(text.get("rms_norm_eps", 1e-5)),
    )


class Dense(nnx.Module):
    """``x @ kernel (+ bias)``; ``kernel`` is ``[in, out]`` (HF's ``weight`` transposed)."""

    def __init__(self, features: tuple[int, int], bias: bool, dtype: jnp.dtype) -> None:
        self.kernel = nnx.Param(jnp.zeros(features, dtype))
        self.bias = nnx.Param(jnp.zeros((features[1],), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        y = x @ self.kernel.get_value()
        return y if self.bias is None else y + self.bias.get_value()


class Mistral3Projector(nnx.Module):
    """Packed patch vectors ``[num_patches, vision_hidden]`` (merge windows together) to soft
    tokens ``[num_patches / merge**2, text_hidden]``."""

    def __init__(self, cfg: Mistral3VisionConfig, dtype: jnp.dtype) -> None:
        self.cfg = cfg
        vision, text, merged = cfg.tower.hidden_size, cfg.text_hidden_size, cfg.patch_multiple
        self.norm = RMSNorm(vision, cfg.norm_eps, dtype)
        self.merging_layer = Dense((vision * merged, vision), False, dtype)
        self.linear_1 = Dense((vision, text), cfg.projector_bias, dtype)
        self.linear_2 = Dense((text, text), cfg.projector_bias, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        n, d = x.shape
        merged = self.cfg.patch_multiple
        h = self.norm(x).reshape(n // merged, merged, d)
        # HF unfolds each window channel by channel: feature c * merge**2 + window offset.
        h = self.merging_layer(h.transpose(0, 2, 1).reshape(n // merged, d * merged))
        h = ACTIVATIONS[self.cfg.projector_activation](self.linear_1(h))
        return self.linear_2(h)


class Mistral3VisionEncoder(nnx.Module):
    def __init__(self, cfg: Mistral3VisionConfig, dtype: jnp.dtype) -> None:
        self.tower = PixtralVisionTower(cfg.tower, dtype)
        self.projector = Mistral3Projector(cfg, dtype)

    def __call__(
        self,
        patches: jax.Array,  # [num_patches, channels * patch_size**2]
        positions: jax.Array,  # [num_patches, 2] int32
        segments: jax.Array,  # [num_patches] int32
    ) -> jax.Array:  # [num_patches / merge**2, text_hidden]
        return self.projector(self.tower(patches, positions, segments))


def _checkpoint_names(cfg: Mistral3VisionConfig) -> dict[str, tuple[Any, ...]]:
    names = {
        name: ("tower", *path)
        for name, path in pixtral_checkpoint_names(cfg.tower, VISION_PREFIX).items()
    }
    names[PROJECTOR_PREFIX + "norm.weight"] = ("projector", "norm", "weight")
    names[PROJECTOR_PREFIX + "patch_merger.merging_layer.weight"] = (
        "projector", "merging_layer", "kernel",
    )  # fmt: skip
    for linear in ("linear_1", "linear_2"):
        names[f"{PROJECTOR_PREFIX}{linear}.weight"] = ("projector", linear, "kernel")
        if cfg.projector_bias:
            names[f"{PROJECTOR_PREFIX}{linear}.bias"] = ("projector", linear, "bias")
    return names


def load(
    cfg: Mistral3VisionConfig, tensors: Mapping[str, np.ndarray], dtype: jnp.dtype
) -> VisionWeights:
    """The encoder from its HF tensors (strict: see ``models.vision.encoder.load_vision``)."""
    return load_vision(Mistral3VisionEncoder(cfg, dtype), _checkpoint_names(cfg), tensors, dtype)


def encode(
    cfg: Mistral3VisionConfig,
    weights: VisionWeights,
    patches: jax.Array,  # [num_patches, channels * patch_size**2] float32
    positions: jax.Array,  # [num_patches, 2] int32
    segments: jax.Array,  # [num_patches] int32
) -> jax.Array:  # [num_patches / merge**2, text_hidden]
    """Soft tokens of packed images (pure: jit it with ``cfg`` static)."""
    return nnx.merge(weights.graphdef, weights.state)(patches, positions, segments)


def _image_patches(
    cfg: Mistral3VisionConfig, pixels: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:  # [n, features], [n, 2]
    """One image's patches and (row, column) positions in the order of its merged tokens (row
    by row), each merge window's patches together (row by row within it)."""
    c, height, width = pixels.shape
    p, m = cfg.patch_size, cfg.spatial_merge_size
    rows, cols = height // p, width // p
    if rows * p != height or cols * p != width or rows % m or cols % m:
        raise ValueError(
            f"an image of {height}x{width} pixels is not a whole number of {p * m}-pixel merge "
            "windows per side"
        )
    # [c, rows/m, m, p, cols/m, m, p] -> [rows/m, cols/m, m, m, c, p, p]
    grid = pixels.reshape(c, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    r, q = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    where = (
        np.stack([r, q], axis=-1).reshape(rows // m, m, cols // m, m, 2).transpose(0, 2, 1, 3, 4)
    )
    return grid.reshape(rows * cols, c * p * p), where.reshape(rows * cols, 2)


def pack(cfg: Mistral3VisionConfig, pixels: Sequence[np.ndarray], num_patches: int) -> PackedImages:
    """``pixels`` (each ``[3, height, width]``) packed into a run of ``num_patches`` patches."""
    return pack_images(cfg, pixels, num_patches, _image_patches)


MISTRAL3_VISION = VisionSpec(
    config_from_hf=mistral3_vision_config_from_hf,
    load=load,
    encode=encode,
    declare=Mistral3VisionEncoder,
    checkpoint_prefixes=(VISION_PREFIX, PROJECTOR_PREFIX),
    rename=canonical_name,
    pack=pack,
    bidirectional=False,
)
