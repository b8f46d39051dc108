"""A vision-language model's images as its HF processor prepares them: pixels exactly as
transformers' Gemma 3 image processor (its Pillow backend) computes them, and the prompt's image
placeholders expanded as ``Gemma3Processor`` expands them.

Pixels: converted to RGB (transparency composited onto white), resized to the encoder's square
input with Pillow (bilinear by default), rescaled by 1/255 in float64 then cast to float32, and
normalized by the mean and std of ``preprocessor_config.json``. Pan-and-scan (extra crops of
wide images) is off, as in Gemma 3's processor defaults.

Prompt: the chat template renders each image as ``<start_of_image>``; each becomes
``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` soft tokens + ``<end_of_image>\\n\\n``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from jax_llm_runtime.runtime.multimodal.inputs import ImageInput

MAX_IMAGES_PER_PROMPT = 4  # --limit-mm-per-prompt's default


@dataclass(frozen=True)
class PixelPreprocessing:
    """The image processor's settings (``preprocessor_config.json``)."""

    size: int  # the square side the encoder takes
    resample: int = Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_hf(cls, preprocessor: dict[str, Any], image_size: int) -> PixelPreprocessing:
        """Settings from a ``preprocessor_config.json`` dict; the encoder's ``image_size`` is
        the size (a processor configured for another size or pan-and-scan is a ValueError)."""
        size = preprocessor.get("size") or {}
        if size and (size.get("height"), size.get("width")) != (image_size, image_size):
            raise ValueError(
                f"preprocessor_config.json resizes to {size}, the vision encoder takes "
                f"{image_size}x{image_size}"
            )
        if preprocessor.get("do_pan_and_scan"):
            raise ValueError("pan-and-scan image preprocessing is not supported")
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if preprocessor.get(flag) is False:
                raise ValueError(f"preprocessor_config.json's {flag}: false is not supported")
        return cls(
            size=image_size,
            resample=int(preprocessor.get("resample", Image.Resampling.BILINEAR)),
            rescale_factor=float(preprocessor.get("rescale_factor", 1 / 255)),
            image_mean=tuple(float(v) for v in preprocessor.get("image_mean", (0.5,) * 3)),
            image_std=tuple(float(v) for v in preprocessor.get("image_std", (0.5,) * 3)),
        )

    def __call__(self, image: Image.Image) -> np.ndarray:  # [3, size, size] float32
        rgb = _to_rgb(image)
        resized = np.array(rgb.resize((self.size, self.size), resample=self.resample))
        pixels = (resized.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.image_mean, np.float32)
        std = np.asarray(self.image_std, np.float32)
        return ((pixels - mean) / std).transpose(2, 0, 1)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageProcessor:
    """What the API needs to put a model's images into a prompt: pixels per image
    (``preprocess``), the template's placeholder and its expansion (``expand``), and the image
    token that the engine finds them by."""

    pixels: PixelPreprocessing
    placeholder: str  # what the chat template renders for one image
    expansion: str  # what the processor puts in its place
    image_token_id: int
    tokens_per_image: int
    max_images: int = MAX_IMAGES_PER_PROMPT

    def preprocess(self, image: Image.Image) -> ImageInput:
        return ImageInput.of(self.pixels(image))

    def expand(self, text: str, num_images: int) -> str:
        """``text`` with each placeholder expanded; a ValueError when their count is not the
        number of images (a client's text may not add or drop image placeholders)."""
        found = text.count(self.placeholder)
        if found != num_images:
            raise ValueError(
                f"the rendered prompt holds {found} image placeholders "
                f"({self.placeholder!r}) for {num_images} images"
            )
        return text.replace(self.placeholder, self.expansion)


def gemma3_processor(
    folder: Path | None, vision_config: Any, token_text: Any, max_images: int
) -> ImageProcessor:
    """Gemma 3's processor: ``token_text(id)`` spells a token (the tokenizer's decode);
    ``folder``'s ``preprocessor_config.json`` when it has one, else Gemma 3's defaults."""
    path = None if folder is None else Path(folder) / "preprocessor_config.json"
    preprocessor = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    boi, eoi = token_text(vision_config.boi_token_id), token_text(vision_config.eoi_token_id)
    soft = token_text(vision_config.image_token_id) * vision_config.tokens_per_image
    return ImageProcessor(
        pixels=PixelPreprocessing.from_hf(preprocessor, vision_config.image_size),
        placeholder=boi,
        expansion=f"\n\n{boi}{soft}{eoi}\n\n",
        image_token_id=vision_config.image_token_id,
        tokens_per_image=vision_config.tokens_per_image,
        max_images=max_images,
    )
