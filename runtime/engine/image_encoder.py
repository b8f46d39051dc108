"""The image encoder of a vision-language model, run apart from the decoder step.

One jitted function (``VisionSpec.encode``: pixels to soft tokens) compiled ahead of time like
the steps, for a few fixed shapes: an encoder of one image size (Gemma 3) for batch sizes 1, 2,
4, ... up to the most images a prompt may hold; an encoder of images of any size (Mistral 3's
Pixtral, Qwen3-VL's tower) for packed runs of 1, 2, 4, ... times a base count of patches, up to
the patches of the largest image the processor makes, the images packed into as few runs as
fit (``VisionSpec.pack``; padding patches are masked). So no image compiles anything new. The
model runner calls it on the loop thread before a step whose prompt chunks first reach
sequences' images, once for all of them (several requests' images packed together), and
keeps each sequence's soft tokens with it (``runtime.multimodal.inputs.SequenceImages``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jax_llm_runtime.models.vision.encoder import VisionSpec, VisionWeights
from jax_llm_runtime.runtime.engine.buckets import geometric, pick
from jax_llm_runtime.runtime.engine.compiled_shapes import CompiledShapes
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput
from jax_llm_runtime.runtime.multimodal.processor import ImageProcessor

# The smallest packed run, in merged tokens (Pixtral: patches / spatial_merge_size**2).
MIN_PACKED_TOKENS = 16


class ImageEncoder:
    """Owns the encoder's weights on device and its compiled shapes (batch sizes, or packed
    patch counts)."""

    def __init__(
        self,
        spec: VisionSpec,
        config: Any,
        weights: VisionWeights,
        processor: ImageProcessor,
    ) -> None:
        self.spec = spec
        self.config = config
        self.weights = weights
        self.processor = processor
        if spec.pack is None:
            self.sizes = geometric(1, max(1, processor.max_images), 2)
        else:  # the most patches of any image the processor makes
            top = getattr(processor.pixels, "max_patches", None)  # Qwen-VL's: a pixel budget
            if top is None:
                side = processor.pixels.max_side  # Pixtral's: a longest side
                top = config.num_patches(side, side)
            self.sizes = geometric(min(MIN_PACKED_TOKENS * config.patch_multiple, top), top, 2)
        self._encode = jax.jit(functools.partial(spec.encode, config))
        self.compiled = CompiledShapes("image encoder", self._lower)

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens attend to each other both ways (``VisionSpec``)."""
        return self.spec.bidirectional

    @property
    def whole_image_tokens(self) -> int:
        """The tokens a prompt chunk must take at once: an image's when they attend to each
        other both ways (a chunk never cuts such an image), else 0."""
        return self.processor.tokens.tokens_per_image if self.bidirectional else 0

    def keys(self) -> list[int]:
        """The batch sizes, or packed patch counts, to compile."""
        return list(self.sizes)

    def _lower(self, size: int) -> Any:
        if self.spec.pack is None:
            side = self.config.image_size
            pixels = jax.ShapeDtypeStruct((size, 3, side, side), np.float32)
            return self._encode.lower(self.weights, pixels)
        return self._encode.lower(
            self.weights,
            jax.ShapeDtypeStruct((size, self.config.patch_features), np.float32),
            jax.ShapeDtypeStruct((size, self.config.position_width), np.int32),
            jax.ShapeDtypeStruct((size,), np.int32),
        )

    def encode(self, images: tuple[ImageInput, ...]) -> list[np.ndarray]:
        """Soft tokens of each image, ``[tokens, text_hidden]`` float32, in compiled shapes."""
        if self.spec.pack is not None:
            return self._encode_packed(images)
        out = []
        largest = self.sizes[-1]
        for first in range(0, len(images), largest):
            group = images[first : first + largest]
            bucket = pick(self.sizes, len(group))
            pixels = np.zeros((bucket, *group[0].pixels.shape), np.float32)
            for i, image in enumerate(group):
                pixels[i] = image.pixels
            soft = self.compiled.get(bucket)(self.weights, pixels)
            out += list(np.asarray(soft, np.float32)[: len(group)])
        return out

    def _encode_packed(self, images: tuple[ImageInput, ...]) -> list[np.ndarray]:
        """Images packed in order into runs of at most the largest compiled count."""
        assert self.spec.pack is not None
        counts = [self.config.num_patches(*image.pixels.shape[1:]) for image in images]
        groups: list[list[int]] = []
        total = self.sizes[-1] + 1
        for i, count in enumerate(counts):
            if count > self.sizes[-1]:
                raise ValueError(f"an image of {count} patches exceeds {self.sizes[-1]}")
            if total + count > self.sizes[-1]:
                groups.append([])
                total = 0
            groups[-1].append(i)
            total += count
        out = []
        for group in groups:
            bucket = pick(self.sizes, sum(counts[i] for i in group))
            packed = self.spec.pack(self.config, [images[i].pixels for i in group], bucket)
            soft = self.compiled.get(bucket)(
                self.weights, packed.patches, packed.positions, packed.segments
            )
            soft = np.asarray(soft, np.float32)
            ends = np.cumsum(packed.tokens)
            out += [soft[end - n : end] for n, end in zip(packed.tokens, ends, strict=True)]
        return out
