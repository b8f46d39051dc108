"""Mistral 3's images as transformers' ``PixtralProcessor`` prepares them: images of any size.

Pixels (``PixtralPreprocessing``, as ``PixtralImageProcessor``'s Pillow backend): converted to
RGB, scaled down (floor of each side over the larger of the two ratios to ``longest_edge``)
when a side is longer than ``longest_edge``, then each side rounded up to a multiple of the
merged patch (``patch_size * spatial_merge_size``), resized to that with Pillow (bicubic by
default), rescaled and normalized by the mean and std of ``preprocessor_config.json``. The
aspect ratio is kept, so images differ in size and in tokens.

Prompt (``GridImageTokens``): the chat template renders each image as ``[IMG]``; it becomes one
``[IMG]`` per merged patch, row by row, each row followed by ``[IMG_BREAK]``, the last one's
replaced by ``[IMG_END]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from jax_llm_runtime.runtime.multimodal.inputs import ImageInput, SequenceImages, delimited_spans
from jax_llm_runtime.runtime.multimodal.processor import (
    ImageProcessor,
    normalized,
    read_preprocessor,
    to_rgb,
)

PIXTRAL_MEAN = (0.48145466, 0.4578275, 0.40821073)
PIXTRAL_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PixtralPreprocessing:
    """The image processor's settings: ``longest_edge`` bounds the larger side, and each side
    is a multiple of ``multiple`` pixels (the merged patch)."""

    longest_edge: int
    multiple: int
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = PIXTRAL_MEAN
    image_std: tuple[float, float, float] = PIXTRAL_STD

    def __post_init__(self) -> None:
        if self.longest_edge < self.multiple or self.multiple < 1:
            raise ValueError(
                f"longest_edge {self.longest_edge} must be at least one patch of {self.multiple}"
            )

    @classmethod
    def from_hf(cls, preprocessor: dict[str, Any], multiple: int) -> PixtralPreprocessing:
        """Settings from a ``preprocessor_config.json`` dict (``size.longest_edge``)."""
        size = preprocessor.get("size") or {"longest_edge": 1024}
        if "longest_edge" not in size:
            raise ValueError(f"preprocessor_config.json's size {size} has no longest_edge")
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if preprocessor.get(flag) is False:
                raise ValueError(f"preprocessor_config.json's {flag}: false is not supported")
        if preprocessor.get("do_center_crop"):
            raise ValueError("preprocessor_config.json's do_center_crop is not supported")
        return cls(
            longest_edge=int(size["longest_edge"]),
            multiple=multiple,
            resample=int(preprocessor.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(preprocessor.get("rescale_factor", 1 / 255)),
            image_mean=tuple(float(v) for v in preprocessor.get("image_mean", PIXTRAL_MEAN)),
            image_std=tuple(float(v) for v in preprocessor.get("image_std", PIXTRAL_STD)),
        )

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        m = self.multiple
        return ((height - 1) // m + 1) * m, ((width - 1) // m + 1) * m

    @property
    def max_side(self) -> int:
        """The longest side, in pixels, of any resized image."""
        return self.output_size(self.longest_edge, self.longest_edge)[0]

    def __call__(self, image: Image.Image) -> np.ndarray:  # [3, height, width] float32
        height, width = self.output_size(image.height, image.width)
        resized = to_rgb(image).resize((width, height), resample=self.resample)
        return normalized(resized, self.rescale_factor, self.image_mean, self.image_std)


@dataclass(frozen=True)
class GridImageTokens:
    """An image as ``[IMG]`` per merged patch, ``[IMG_BREAK]`` after each row, ``[IMG_END]``
    last; the ``[IMG]`` tokens take the soft tokens, causally (Mistral 3)."""

    image: tuple[str, int]  # [IMG]: (text, id)
    row_break: tuple[str, int]  # [IMG_BREAK]
    end: tuple[str, int]  # [IMG_END]
    multiple: int  # pixels per merged patch, per side
    max_side: int  # the longest side, in pixels, the encoder's compiled shapes hold

    @property
    def image_token_id(self) -> int:
        return self.image[1]

    def grid(self, image: ImageInput) -> tuple[int, int]:
        """(rows, columns) of the image's merged patches."""
        _, height, width = image.pixels.shape
        return height // self.multiple, width // self.multiple

    def _layout(self, image: ImageInput, spell: int) -> list[Any]:
        rows, cols = self.grid(image)
        row = [self.image[spell]] * cols + [self.row_break[spell]]
        out = row * rows
        out[-1] = self.end[spell]
        return out

    def expansion(self, image: ImageInput) -> str:
        return "".join(self._layout(image, 0))

    def _check_size(self, index: int, image: ImageInput) -> None:
        """A ValueError for pixels this processor does not make (a library caller's own)."""
        shape = image.pixels.shape
        sides = shape[1:]
        if len(shape) != 3 or any(side % self.multiple or side > self.max_side for side in sides):
            raise ValueError(
                f"image {index}'s pixels {shape} are not [3, height, width] with sides multiples "
                f"of {self.multiple} up to {self.max_side}"
            )

    def locate(
        self, prompt_ids: list[int], images: tuple[ImageInput, ...]
    ) -> SequenceImages | None:
        members = (self.image[1], self.row_break[1], self.end[1])
        spans = delimited_spans(prompt_ids, members, self.end[1])
        if not spans and not images:
            return None
        if len(spans) != len(images):  # SequenceImages says so
            return SequenceImages(tuple(images), tuple(spans))
        soft_index = []
        for i, ((a, b), image) in enumerate(zip(spans, images, strict=True)):
            self._check_size(i, image)
            expected = np.asarray(self._layout(image, 1))
            if b - a != len(expected) or not np.array_equal(prompt_ids[a:b], expected):
                rows, cols = self.grid(image)
                raise ValueError(
                    f"the image tokens at position {a} are not image {i}'s grid of {rows} rows "
                    f"of {cols} merged patches"
                )
            taken = expected == self.image[1]
            soft_index.append(np.where(taken, np.cumsum(taken) - 1, -1).astype(np.int32))
        return SequenceImages(
            tuple(images), tuple(spans), soft_index=tuple(soft_index), bidirectional=False
        )


def mistral3_processor(
    folder: Path | None, vision_config: Any, token_id: Any, max_images: int
) -> ImageProcessor:
    """Mistral 3's processor: ``token_id(text)`` is the one id the tokenizer gives a special
    token's text; ``folder``'s ``preprocessor_config.json`` and ``processor_config.json`` (the
    image tokens' texts) when it has them, else Pixtral's defaults."""
    texts = read_preprocessor(folder, "processor_config.json")
    spelled = {}
    for key, default in (
        ("image_token", "[IMG]"),
        ("image_break_token", "[IMG_BREAK]"),
        ("image_end_token", "[IMG_END]"),
    ):
        text = texts.get(key, default)
        spelled[key] = (text, token_id(text))
    if spelled["image_token"][1] != vision_config.image_token_id:
        raise ValueError(
            f"the tokenizer's {spelled['image_token'][0]} is id {spelled['image_token'][1]}, "
            f"the model's image_token_id is {vision_config.image_token_id}"
        )
    multiple = vision_config.patch_size * vision_config.spatial_merge_size
    pixels = PixtralPreprocessing.from_hf(read_preprocessor(folder), multiple)
    tokens = GridImageTokens(
        spelled["image_token"],
        spelled["image_break_token"],
        spelled["image_end_token"],
        multiple,
        pixels.max_side,
    )
    return ImageProcessor(
        pixels=pixels,
        placeholder=spelled["image_token"][0],
        tokens=tokens,
        max_images=max_images,
    )
