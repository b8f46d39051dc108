"""Gemma 3's image encoder: the SigLIP tower, then the multimodal projector (average-pool the
patch grid to ``mm_tokens_per_image`` tokens, Gemma's RMSNorm with weights stored as offsets
from 1, a projection to the text model's width). Its output replaces the embeddings of the
prompt's image soft tokens (``image_token_id``); the decoder (``models.families.gemma``) is
Gemma 3's text model, which lets the soft tokens of one image attend to each other both ways
(``models.batch.StepBatch.horizons``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_llm_runtime.models import checkpoint
from jax_llm_runtime.models.vision.encoder import VisionSpec, VisionWeights, load_vision
from jax_llm_runtime.models.vision.siglip import (
    SiglipConfig,
    SiglipVisionTower,
    siglip_checkpoint_names,
    siglip_config_from_hf,
)

VISION_PREFIX = "model.vision_tower.vision_model."
PROJECTOR_PREFIX = "model.multi_modal_projector."


def canonical_name(name: str) -> str:
    """A Gemma 3 multimodal checkpoint name in one spelling: checkpoints on the Hub (and
    ``save_pretrained`` of transformers 5) write ``language_model.model.*``, ``vision_tower.*``
    (with or without ``vision_model.``) and ``multi_modal_projector.*``; transformers 4.5x
    wrote them under ``model.``. The text model's rules read ``model.language_model.*``."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        return VISION_PREFIX + name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if name.startswith("multi_modal_projector."):
        return "model." + name
    return name


# The text model of the checkpoint (names made canonical; the encoder's are skipped).
load_text = functools.partial(checkpoint.load_renamed, canonical_name)


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """The encoder's shape and the prompt tokens that carry its output."""

    tower: SiglipConfig
    text_hidden_size: int
    mm_tokens_per_image: int
    image_token_id: int  # the soft token whose embedding an image token replaces
    boi_token_id: int  # <start_of_image>: the chat template's placeholder for one image
    eoi_token_id: int  # <end_of_image>

    def __post_init__(self) -> None:
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image:
            raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square")
        if self.tower.patches_per_side % side:
            raise ValueError(
                f"{self.tower.patches_per_side} patches per side do not pool evenly to {side}"
            )

    @property
    def tokens_per_image(self) -> int:
        return self.mm_tokens_per_image

    @property
    def image_size(self) -> int:
        return self.tower.image_size

    @property
    def pool(self) -> int:
        """The side of the average-pooling window, in patches."""
        return self.tower.patches_per_side // math.isqrt(self.mm_tokens_per_image)


def gemma3_vision_config_from_hf(hf: dict[str, Any]) -> Gemma3VisionConfig:
    """The encoder of an HF ``Gemma3ForConditionalGeneration`` config."""
    text = hf.get("text_config") or {}
    ids = {
        name: int(hf.get(name, hf.get(old, default)))
        for name, old, default in (
            ("image_token_id", "image_token_index", 262_144),
            ("boi_token_id", "boi_token_index", 255_999),
            ("eoi_token_id", "eoi_token_index", 256_000),
        )
    }
    return Gemma3VisionConfig(
        tower=siglip_config_from_hf(hf.get("vision_config") or {}),
        text_hidden_size=int(text.get("hidden_size", 2304)),
        mm_tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
        **ids,
    )


class Gemma3Projector(nnx.Module):
    """Patch vectors ``[n, num_patches, vision_hidden]`` to soft tokens
    ``[n, mm_tokens_per_image, text_hidden]``."""

    def __init__(self, cfg: Gemma3VisionConfig, dtype: jnp.dtype) -> None:
        self.cfg = cfg
        vision = cfg.tower.hidden_size
        self.norm_weight = nnx.Param(jnp.zeros((vision,), dtype))
        self.projection = nnx.Param(jnp.zeros((vision, cfg.text_hidden_size), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        n, _, d = x.shape
        side, k = cfg.tower.patches_per_side // cfg.pool, cfg.pool
        pooled = x.reshape(n, side, k, side, k, d).mean(axis=(2, 4), dtype=jnp.float32)
        pooled = pooled.astype(x.dtype).reshape(n, side * side, d)
        h = pooled.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + cfg.tower.layer_norm_eps)
        h = (h * (1.0 + self.norm_weight.get_value().astype(jnp.float32))).astype(x.dtype)
        return (h @ self.projection.get_value()).astype(x.dtype)


class Gemma3VisionEncoder(nnx.Module):
    def __init__(self, cfg: Gemma3VisionConfig, dtype: jnp.dtype) -> None:
        self.tower = SiglipVisionTower(cfg.tower, dtype)
        self.projector = Gemma3Projector(cfg, dtype)

    def __call__(
        self,
        pixels: jax.Array,  # [num_images, 3, image_size, image_size]
    ) -> jax.Array:  # [num_images, mm_tokens_per_image, text_hidden]
        return self.projector(self.tower(pixels))


def _checkpoint_names(cfg: Gemma3VisionConfig) -> dict[str, tuple[Any, ...]]:
    names = {
        name: ("tower", *path)
        for name, path in siglip_checkpoint_names(cfg.tower, VISION_PREFIX).items()
    }
    names[PROJECTOR_PREFIX + "mm_soft_emb_norm.weight"] = ("projector", "norm_weight")
    names[PROJECTOR_PREFIX + "mm_input_projection_weight"] = ("projector", "projection")
    return names


def load(
    cfg: Gemma3VisionConfig, tensors: Mapping[str, np.ndarray], dtype: jnp.dtype
) -> VisionWeights:
    """The encoder from its HF tensors (strict: see ``models.vision.encoder.load_vision``)."""
    return load_vision(Gemma3VisionEncoder(cfg, dtype), _checkpoint_names(cfg), tensors, dtype)


def encode(
    cfg: Gemma3VisionConfig,
    weights: VisionWeights,
    pixels: jax.Array,  # [num_images, 3, image_size, image_size] float32
) -> jax.Array:  # [num_images, mm_tokens_per_image, text_hidden]
    """Soft tokens of each image (pure: jit it with ``cfg`` static)."""
    return nnx.merge(weights.graphdef, weights.state)(pixels)


GEMMA3_VISION = VisionSpec(
    config_from_hf=gemma3_vision_config_from_hf,
    load=load,
    encode=encode,
    declare=Gemma3VisionEncoder,
    checkpoint_prefixes=(VISION_PREFIX, PROJECTOR_PREFIX),
    rename=canonical_name,
)
