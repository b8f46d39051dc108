"""Qwen3-VL's images as transformers' ``Qwen3VLProcessor`` prepares them: images of any size,
resized to a pixel budget.

Pixels (``QwenVLPreprocessing``, as ``Qwen2VLImageProcessor``'s Pillow backend, before it cuts
patches): converted to RGB, resized with Pillow (bicubic by default) so that each side is a
multiple of the merged patch (``patch_size * merge_size``) and the area lies between
``min_pixels`` and ``max_pixels`` (``smart_resize``: each side rounded to the nearest multiple,
then the image scaled down or up, keeping its aspect, when the area falls outside the bounds),
rescaled and normalized by the mean and std of ``preprocessor_config.json``. An aspect ratio
over 200 is refused.

Prompt (``QwenVLImageTokens``): the chat template renders each image as
``<|vision_start|><|image_pad|><|vision_end|>``; its ``<|image_pad|>`` becomes one
``<|image_pad|>`` per merged patch, row by row, each taking a soft token, causally. The images'
merged patch grids go with them (``SequenceImages.grids``) for M-RoPE's positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from jax_llm_runtime.runtime.multimodal.decode import ImageError
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput, SequenceImages
from jax_llm_runtime.runtime.multimodal.processor import (
    ImageProcessor,
    normalized,
    read_preprocessor,
    to_rgb,
)

QWEN3_VL_MEAN = (0.5, 0.5, 0.5)
QWEN3_VL_STD = (0.5, 0.5, 0.5)
QWEN3_VL_MIN_PIXELS = 65536  # Qwen3-VL's published size.shortest_edge
QWEN3_VL_MAX_PIXELS = 16777216  # and size.longest_edge: 65,536 patches of 16
# The server's bound on an image's area: 1024 merged patches of 32x32 (4096 patches of 16),
# so a 1024x1024 image keeps its size; a larger one is scaled down to it.
MAX_PIXELS = 1024 * 1024
MAX_ASPECT_RATIO = 200
IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True)
class QwenVLPreprocessing:
    """The image processor's settings: a resized image's sides are multiples of ``factor``
    (the merged patch) and its area lies between ``min_pixels`` and ``max_pixels``."""

    patch_size: int
    merge_size: int
    min_pixels: int = QWEN3_VL_MIN_PIXELS
    max_pixels: int = QWEN3_VL_MAX_PIXELS
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = QWEN3_VL_MEAN
    image_std: tuple[float, float, float] = QWEN3_VL_STD

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.merge_size < 1:
            raise ValueError(
                f"patch_size {self.patch_size} and merge_size {self.merge_size} must be positive"
            )
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"min_pixels {self.min_pixels} and max_pixels {self.max_pixels} must satisfy "
                "0 < min_pixels <= max_pixels"
            )

    @classmethod
    def from_hf(
        cls,
        preprocessor: dict[str, Any],
        patch_size: int,
        merge_size: int,
        max_pixels_cap: int | None = None,
    ) -> QwenVLPreprocessing:
        """Settings from a ``preprocessor_config.json`` dict (``size.shortest_edge`` and
        ``size.longest_edge``, or the older ``min_pixels`` and ``max_pixels``, which take
        precedence as in transformers; Qwen3-VL's published values where absent), for the
        encoder's ``patch_size`` and ``merge_size``; ``max_pixels_cap`` lowers ``max_pixels``
        (and ``min_pixels`` with it when it is above)."""
        for key, value in (("patch_size", patch_size), ("merge_size", merge_size)):
            if preprocessor.get(key, value) != value:
                raise ValueError(
                    f"preprocessor_config.json's {key} is {preprocessor[key]}, the vision "
                    f"encoder's is {value}"
                )
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if preprocessor.get(flag) is False:
                raise ValueError(f"preprocessor_config.json's {flag}: false is not supported")
        size = preprocessor.get("size") or {}
        min_pixels = _first(
            preprocessor.get("min_pixels"), size.get("shortest_edge"), QWEN3_VL_MIN_PIXELS
        )
        max_pixels = _first(
            preprocessor.get("max_pixels"), size.get("longest_edge"), QWEN3_VL_MAX_PIXELS
        )
        if max_pixels_cap is not None:
            max_pixels = min(max_pixels, max_pixels_cap)
            min_pixels = min(min_pixels, max_pixels)
        return cls(
            patch_size=patch_size,
            merge_size=merge_size,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            resample=int(preprocessor.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(preprocessor.get("rescale_factor", 1 / 255)),
            image_mean=tuple(float(v) for v in preprocessor.get("image_mean", QWEN3_VL_MEAN)),
            image_std=tuple(float(v) for v in preprocessor.get("image_std", QWEN3_VL_STD)),
        )

    @property
    def factor(self) -> int:
        """A merged patch's side, in pixels."""
        return self.patch_size * self.merge_size

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to (transformers' ``smart_resize``);
        an ``ImageError`` (a 400 over HTTP) for an aspect ratio over 200."""
        if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            raise ImageError(
                f"the image's aspect ratio ({width}x{height} pixels) is over "
                f"{MAX_ASPECT_RATIO}, the most the model's image processor accepts"
            )
        f = self.factor
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / f) * f
            w = math.ceil(width * beta / f) * f
        return h, w

    @property
    def max_patches(self) -> int:
        """The most patches any resized image has: ``max_pixels`` over a patch's area, unless
        the bounds are so small next to the merged patch that a side clamped up to one merged
        patch (an extreme aspect ratio) or ``min_pixels``' sides rounded up pass them."""
        f, ratio = self.factor, MAX_ASPECT_RATIO
        # scaled down, the short side clamped to f: the long side is at most sqrt(ratio * max)
        clamped = f * max(f, math.isqrt(ratio * self.max_pixels) // f * f)
        # scaled up to min_pixels = a * b (b <= ratio * a), each side rounded up by under f:
        # (a + f) * (b + f) < min_pixels + f * (a + b) + f * f, a + b <= sqrt(min * 201^2 / 200)
        sides = math.isqrt((ratio + 1) ** 2 * self.min_pixels // ratio) + 1
        enlarged = self.min_pixels + f * sides + f * f
        return max(self.max_pixels, clamped, enlarged) // self.patch_size**2

    def __call__(self, image: Image.Image) -> np.ndarray:  # [3, height, width] float32
        height, width = self.output_size(image.height, image.width)
        resized = to_rgb(image).resize((width, height), resample=self.resample)
        return normalized(resized, self.rescale_factor, self.image_mean, self.image_std)


def _first(*values: Any) -> int:
    """The first of ``values`` that is not None, as an int."""
    return int(next(v for v in values if v is not None))


def image_runs(
    prompt_ids: list[int], image_token_id: int, lengths: Sequence[int]
) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of image tokens in the prompt, in order; a ValueError when
    there are not ``len(lengths)`` runs or the i-th run is not ``lengths[i]`` tokens long."""
    ids = np.asarray(prompt_ids)
    is_image = ids == image_token_id
    starts = np.flatnonzero(is_image & ~np.concatenate([[False], is_image[:-1]]))
    ends = np.flatnonzero(is_image & ~np.concatenate([is_image[1:], [False]])) + 1
    if len(starts) != len(lengths):
        raise ValueError(
            f"the prompt holds image tokens for {len(starts)} images, the request sends "
            f"{len(lengths)}"
        )
    spans = [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]
    for i, ((start, end), length) in enumerate(zip(spans, lengths, strict=True)):
        if end - start != length:
            raise ValueError(
                f"the prompt holds {end - start} image tokens in a row at position {start}; "
                f"image {i} is {length}"
            )
    return spans


@dataclass(frozen=True)
class QwenVLImageTokens:
    """An image as ``<|image_pad|>`` per merged patch, row by row; each takes a soft token,
    causally, at M-RoPE positions from its image's grid (Qwen3-VL)."""

    image: tuple[str, int]  # <|image_pad|>: (text, id)
    patch_size: int
    merge_size: int
    max_patches: int  # the most patches, per image, the encoder's compiled shapes hold

    @property
    def image_token_id(self) -> int:
        return self.image[1]

    def grid(self, image: ImageInput) -> tuple[int, int]:
        """(rows, columns) of the image's merged patches."""
        _, height, width = image.pixels.shape
        f = self.patch_size * self.merge_size
        return height // f, width // f

    def expansion(self, image: ImageInput) -> str:
        rows, cols = self.grid(image)
        return self.image[0] * (rows * cols)

    def _check_size(self, index: int, image: ImageInput) -> None:
        """A ValueError for pixels this processor does not make (a library caller's own)."""
        shape = image.pixels.shape
        f = self.patch_size * self.merge_size
        if (
            len(shape) != 3
            or shape[0] != 3
            or any(side % f or side == 0 for side in shape[1:])
            or shape[1] * shape[2] > self.max_patches * self.patch_size**2
        ):
            raise ValueError(
                f"image {index}'s pixels {shape} are not [3, height, width] with sides multiples "
                f"of {f} and at most {self.max_patches} patches of {self.patch_size}"
            )

    def locate(
        self, prompt_ids: list[int], images: tuple[ImageInput, ...]
    ) -> SequenceImages | None:
        for i, image in enumerate(images):
            self._check_size(i, image)
        grids = tuple(self.grid(image) for image in images)
        spans = image_runs(prompt_ids, self.image[1], [rows * cols for rows, cols in grids])
        if not spans and not images:
            return None
        return SequenceImages(tuple(images), tuple(spans), bidirectional=False, grids=grids)


def qwen3_vl_processor(
    folder: Path | None, vision_config: Any, token_id: Any, max_images: int
) -> ImageProcessor:
    """Qwen3-VL's processor: ``token_id(text)`` is the one id the tokenizer gives a special
    token's text; ``folder``'s ``preprocessor_config.json`` when it has one, else Qwen3-VL's
    published settings. ``max_pixels`` is capped at ``MAX_PIXELS`` (the published 16,777,216
    would be 65,536 patches, 16,384 soft tokens, per image) to bound the encoder's memory and
    compiled shapes; vLLM leaves this to a processor kwarg, the server fixes it."""
    image_id = token_id(IMAGE_PAD)
    if image_id != vision_config.image_token_id:
        raise ValueError(
            f"the tokenizer's {IMAGE_PAD} is id {image_id}, the model's image_token_id is "
            f"{vision_config.image_token_id}"
        )
    patch, merge = vision_config.patch_size, vision_config.spatial_merge_size
    pixels = QwenVLPreprocessing.from_hf(read_preprocessor(folder), patch, merge, MAX_PIXELS)
    return ImageProcessor(
        pixels=pixels,
        placeholder=IMAGE_PAD,
        tokens=QwenVLImageTokens((IMAGE_PAD, image_id), patch, merge, pixels.max_patches),
        max_images=max_images,
    )
