"""A vision-language model's images as its HF processor prepares them (``ImageProcessor``: the
pixels, the prompt's placeholders expanded, the image tokens found again in the prompt's ids);
here Gemma 3's, whose images are all one size (Mistral 3's, of any size: ``pixtral``): pixels
exactly as transformers' Gemma 3 image processor (its Pillow backend) computes them, and the
prompt's image placeholders expanded as ``Gemma3Processor`` expands them.

Pixels: converted to RGB (transparency composited onto white), resized to the encoder's square
input with Pillow (bilinear by default), rescaled by 1/255 in float64 then cast to float32, and
normalized by the mean and std of ``preprocessor_config.json``. Pan-and-scan (extra crops of
wide images) is off, as in Gemma 3's processor defaults.

Prompt: the chat template renders each image as ``<start_of_image>``; each becomes
``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` soft tokens + ``<end_of_image>\\n\\n``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from jax_llm_runtime.runtime.multimodal.inputs import ImageInput, SequenceImages, image_spans

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
        resized = to_rgb(image).resize((self.size, self.size), resample=self.resample)
        return normalized(resized, self.rescale_factor, self.image_mean, self.image_std)


def normalized(
    image: Image.Image, rescale_factor: float, mean: Sequence[float], std: Sequence[float]
) -> np.ndarray:  # [3, height, width] float32
    """An RGB image's pixels rescaled (in float64, then cast to float32, as transformers'
    ``rescale``) and normalized by channel."""
    pixels = (np.array(image).astype(np.float64) * rescale_factor).astype(np.float32)
    mean_, std_ = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    return ((pixels - mean_) / std_).transpose(2, 0, 1)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


class ImageTokens(Protocol):
    """How a model spells an image in its prompt: what the processor puts for each image, and
    where the images' tokens are found in a prompt's ids."""

    image_token_id: int  # the token whose embedding a soft token replaces

    def expansion(self, image: ImageInput) -> str:
        """The text that stands for ``image`` (the template's placeholder expanded)."""
        ...

    def locate(
        self, prompt_ids: list[int], images: tuple[ImageInput, ...]
    ) -> SequenceImages | None:
        """``images`` placed at their tokens in the prompt; a ValueError when they do not
        match; None for a prompt with neither."""
        ...


@dataclass(frozen=True)
class FixedImageTokens:
    """Images that are each the same ``expansion``, holding a run of ``tokens_per_image`` image
    tokens that attend to each other both ways (Gemma 3)."""

    text: str
    image_token_id: int
    tokens_per_image: int

    def expansion(self, image: ImageInput) -> str:
        return self.text

    def locate(
        self, prompt_ids: list[int], images: tuple[ImageInput, ...]
    ) -> SequenceImages | None:
        spans = image_spans(prompt_ids, self.image_token_id, self.tokens_per_image)
        if not spans and not images:
            return None
        return SequenceImages(tuple(images), tuple(spans))


@dataclass(frozen=True)
class ImageProcessor:
    """What the API needs to put a model's images into a prompt: pixels per image
    (``preprocess``), the template's placeholder and its expansion per image (``expand``), and
    how the engine finds the images' tokens (``tokens``)."""

    pixels: Callable[[Image.Image], np.ndarray]  # an image to [3, height, width] float32
    placeholder: str  # what the chat template renders for one image
    tokens: ImageTokens
    max_images: int = MAX_IMAGES_PER_PROMPT

    @property
    def image_token_id(self) -> int:
        return self.tokens.image_token_id

    def preprocess(self, image: Image.Image) -> ImageInput:
        return ImageInput.of(self.pixels(image))

    def expand(self, text: str, images: Sequence[ImageInput]) -> str:
        """``text`` with its i-th placeholder expanded for ``images[i]``; a ValueError when
        their count is not the number of images (a client's text may not add or drop image
        placeholders)."""
        pieces = text.split(self.placeholder)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"the rendered prompt holds {len(pieces) - 1} image placeholders "
                f"({self.placeholder!r}) for {len(images)} images"
            )
        out = [pieces[0]]
        for image, piece in zip(images, pieces[1:], strict=True):
            out += [self.tokens.expansion(image), piece]
        return "".join(out)

    def locate(
        self, prompt_ids: list[int], images: tuple[ImageInput, ...]
    ) -> SequenceImages | None:
        """Where the prompt's images go (``ImageTokens.locate``); a ValueError for more than
        ``max_images``, or image tokens that do not match the images."""
        if len(images) > self.max_images:
            raise ValueError(
                f"the prompt holds {len(images)} images; at most {self.max_images} are "
                "accepted (--limit-mm-per-prompt)"
            )
        return self.tokens.locate(prompt_ids, images)


def read_preprocessor(folder: Path | None, name: str = "preprocessor_config.json") -> dict:
    """``folder``'s processor settings file as a dict; empty when there is none."""
    path = None if folder is None else Path(folder) / name
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def gemma3_processor(
    folder: Path | None, vision_config: Any, token_text: Any, max_images: int
) -> ImageProcessor:
    """Gemma 3's processor: ``token_text(id)`` spells a token (the tokenizer's decode);
    ``folder``'s ``preprocessor_config.json`` when it has one, else Gemma 3's defaults."""
    boi, eoi = token_text(vision_config.boi_token_id), token_text(vision_config.eoi_token_id)
    soft = token_text(vision_config.image_token_id) * vision_config.tokens_per_image
    tokens = FixedImageTokens(
        f"\n\n{boi}{soft}{eoi}\n\n", vision_config.image_token_id, vision_config.tokens_per_image
    )
    return ImageProcessor(
        pixels=PixelPreprocessing.from_hf(read_preprocessor(folder), vision_config.image_size),
        placeholder=boi,
        tokens=tokens,
        max_images=max_images,
    )
