"""Qwen3-VL's image encoder: the Qwen3-VL tower (``models.vision.qwen3_vl``) over images of any
size, with its patch merger and deepstack mergers. Its output per merged patch is the token
that replaces the embedding of one of the prompt's ``<|image_pad|>`` tokens, then one token per
deepstack level, which the decoder adds to the image rows' hidden states after its first layers
(level ``i`` after layer ``i``); the decoder attends over the image tokens causally, as over
text.

A still image is ``temporal_patch_size`` identical frames, as HF's image processor makes it,
and enters the tower packed (``models.vision.encoder.PackedImages``): each image's patches in
the order of its merged tokens, each merge window's ``spatial_merge_size**2`` patches together,
exactly HF's ``pixel_values`` for it; each patch's position holds its image's grid too, which
the tower's position table is resampled to.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_llm_runtime.models import checkpoint
from jax_llm_runtime.models.vision.encoder import (
    PackedImages,
    VisionSpec,
    VisionWeights,
    load_vision,
    pack_images,
)
from jax_llm_runtime.models.vision.qwen3_vl import (
    Qwen3VLTowerConfig,
    Qwen3VLVisionTower,
    qwen3_vl_checkpoint_names,
    qwen3_vl_tower_config_from_hf,
)

VISION_PREFIX = "model.visual."
POSITION_WIDTH = 4  # a patch's (row, column, image rows, image columns)

# Checkpoints that transformers 5.10 to 5.23 saved with a doubled ``.model`` in the text
# model's names (HF renames them on loading, for every model).
_DOUBLED = ("model.language_model.model.", "language_model.model.model.")


def canonical_name(name: str) -> str:
    """A Qwen3-VL checkpoint name in one spelling: ``save_pretrained`` of transformers 5 and
    the checkpoints on the Hub write ``model.visual.*``, ``model.language_model.*`` and
    ``lm_head.*`` (HF maps no other layout for Qwen3-VL) except for the doubled
    ``model.language_model.model.*`` and ``language_model.model.model.*`` of a few transformers
    releases. The text model's rules read ``model.language_model.*``."""
    for doubled in _DOUBLED:
        if name.startswith(doubled):
            return "model.language_model." + name.removeprefix(doubled)
    return name


# The text model of the checkpoint (names made canonical; the encoder's are skipped).
load_text = functools.partial(checkpoint.load_renamed, canonical_name)

_EXPERT_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def load_text_moe(
    cfg: Any, tensors: Iterable[tuple[str, Any]], dtype: Any, num_tensors: int | None = None,
    *, rules: Sequence[Any],
) -> Any:  # fmt: skip
    """``load_text`` of a Qwen3-VL-MoE checkpoint, whose expert stacks come in two layouts:
    released checkpoints store ``gate_up_proj`` ``[experts, hidden, 2 * inter]`` and
    ``down_proj`` ``[experts, inter, hidden]``, transformers 5 (and its ``save_pretrained``)
    ``[experts, 2 * inter, hidden]`` and ``[experts, hidden, inter]``, which the rules read. A
    stack is turned when its shape is the released one and not also the other (transformers
    turns it on the same condition)."""
    h, i = cfg.hidden_size, cfg.moe.expert_intermediate_size
    released = {_EXPERT_STACKS[0]: (h, 2 * i), _EXPERT_STACKS[1]: (i, h)}

    def stacks() -> Iterator[tuple[str, Any]]:
        for name, value in tensors:
            name = canonical_name(name)
            kind = next((k for k in _EXPERT_STACKS if name.endswith(k)), None)
            shape = None if kind is None else released[kind]
            if shape is not None and tuple(value.shape[1:]) == shape and shape[0] != shape[1]:
                value = np.swapaxes(np.asarray(value), 1, 2)
            yield name, value

    return checkpoint.load(cfg, stacks(), dtype, num_tensors, rules=rules)


@dataclass(frozen=True)
class Qwen3VLVisionConfig:
    """The encoder's shape and the prompt token that carries its output."""

    tower: Qwen3VLTowerConfig
    text_hidden_size: int
    image_token_id: int  # <|image_pad|>: one per merged patch

    def __post_init__(self) -> None:
        if self.tower.out_hidden_size != self.text_hidden_size:
            raise ValueError(
                f"vision out_hidden_size {self.tower.out_hidden_size} is not the text model's "
                f"hidden_size {self.text_hidden_size}"
            )

    @property
    def patch_size(self) -> int:
        return self.tower.patch_size

    @property
    def spatial_merge_size(self) -> int:
        return self.tower.spatial_merge_size

    @property
    def temporal_patch_size(self) -> int:
        return self.tower.temporal_patch_size

    @property
    def patch_multiple(self) -> int:
        """Patches per merged token: every packed run is a multiple of it."""
        return self.tower.spatial_merge_size**2

    @property
    def patch_features(self) -> int:
        """Features of one packed patch: channels * temporal_patch_size * patch_size**2."""
        return self.tower.patch_features

    @property
    def position_width(self) -> int:
        """Columns of ``PackedImages.positions``: (row, column, image rows, image columns)."""
        return POSITION_WIDTH

    @property
    def deepstack_levels(self) -> int:
        return len(self.tower.deepstack_visual_indexes)

    @property
    def out_width(self) -> int:
        """Columns of ``encode``'s output: the image tokens, then each deepstack level's."""
        return (1 + self.deepstack_levels) * self.text_hidden_size

    def num_patches(self, height: int, width: int) -> int:
        """Patches of a ``height x width`` image (each side a multiple of patch * merge)."""
        return (height // self.patch_size) * (width // self.patch_size)


def qwen3_vl_vision_config_from_hf(hf: dict[str, Any]) -> Qwen3VLVisionConfig:
    """The encoder of an HF ``Qwen3VLForConditionalGeneration`` config."""
    text = hf.get("text_config") or {}
    return Qwen3VLVisionConfig(
        tower=qwen3_vl_tower_config_from_hf(hf.get("vision_config") or {}),
        text_hidden_size=int(text.get("hidden_size", 4096)),
        image_token_id=int(hf.get("image_token_id", 151655)),
    )


def qwen3_5_vision_config_from_hf(hf: dict[str, Any]) -> Qwen3VLVisionConfig:
    """The encoder of an HF ``Qwen3_5ForConditionalGeneration`` (or its MoE's) config: Qwen3-VL's
    tower and merger without deepstack levels."""
    vision = {**(hf.get("vision_config") or {})}
    vision.setdefault("deepstack_visual_indexes", ())
    return qwen3_vl_vision_config_from_hf({**hf, "vision_config": vision})


def load(
    cfg: Qwen3VLVisionConfig, tensors: Mapping[str, np.ndarray], dtype: jnp.dtype
) -> VisionWeights:
    """The encoder from its HF tensors (strict: see ``models.vision.encoder.load_vision``)."""
    names = qwen3_vl_checkpoint_names(cfg.tower, VISION_PREFIX)
    return load_vision(Qwen3VLVisionTower(cfg.tower, dtype), names, tensors, dtype)


def declare(cfg: Qwen3VLVisionConfig, dtype: jnp.dtype) -> nnx.Module:
    """The encoder module (the tower with its mergers), parameters unfilled."""
    return Qwen3VLVisionTower(cfg.tower, dtype)


def encode(
    cfg: Qwen3VLVisionConfig,
    weights: VisionWeights,
    patches: jax.Array,  # [num_patches, patch_features] float32
    positions: jax.Array,  # [num_patches, 4] int32
    segments: jax.Array,  # [num_patches] int32
) -> jax.Array:  # [num_patches / merge**2, out_width]
    """Packed images' tokens (pure: jit it with ``cfg`` static): columns ``[:text_hidden]`` are
    the image tokens, then each deepstack level's ``text_hidden`` columns in
    ``deepstack_visual_indexes`` order."""
    return nnx.merge(weights.graphdef, weights.state)(patches, positions, segments)


def _image_patches(
    cfg: Qwen3VLVisionConfig, pixels: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:  # [n, patch_features], [n, 4]
    """One image's patches and positions in HF's order: merge windows row by row, each
    window's patches row by row; each patch ``temporal_patch_size`` copies of the image's
    pixels, features in (channel, frame, row, column) order."""
    c, height, width = pixels.shape
    p, m, t = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    rows, cols = height // p, width // p
    if c != cfg.tower.in_channels:
        raise ValueError(f"an image of {c} channels, the encoder takes {cfg.tower.in_channels}")
    if rows * p != height or cols * p != width or rows % m or cols % m:
        raise ValueError(
            f"an image of {height}x{width} pixels is not a whole number of {p * m}-pixel merge "
            "windows per side"
        )
    # [c, rows/m, m, p, cols/m, m, p] -> [rows/m, cols/m, m, m, c, p, p], then the frames.
    grid = pixels.reshape(c, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(grid[:, :, :, :, :, None], (*grid.shape[:5], t, p, p))
    r, q = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    where = (
        np.stack([r, q], axis=-1).reshape(rows // m, m, cols // m, m, 2).transpose(0, 2, 1, 3, 4)
    )
    where = np.concatenate(
        [where.reshape(rows * cols, 2), np.broadcast_to([rows, cols], (rows * cols, 2))], axis=1
    )
    return frames.reshape(rows * cols, cfg.patch_features), where


def pack(cfg: Qwen3VLVisionConfig, pixels: Sequence[np.ndarray], num_patches: int) -> PackedImages:
    """``pixels`` (each ``[3, height, width]``) packed into a run of ``num_patches`` patches."""
    return pack_images(cfg, pixels, num_patches, _image_patches)


QWEN3_VL_VISION = VisionSpec(
    config_from_hf=qwen3_vl_vision_config_from_hf,
    load=load,
    encode=encode,
    declare=declare,
    checkpoint_prefixes=(VISION_PREFIX,),
    rename=canonical_name,
    pack=pack,
    bidirectional=False,
)

# Qwen3.5's (dense and MoE): the same tower, names and prompt tokens, no deepstack levels.
QWEN3_5_VISION = replace(QWEN3_VL_VISION, config_from_hf=qwen3_5_vision_config_from_hf)
