"""The image encoder of a vision-language model, run apart from the decoder step.

One jitted function (``VisionSpec.encode``: pixels to soft tokens) compiled for a few fixed
batch sizes (1, 2, 4, ... up to the most images a prompt may hold; one image size per model),
ahead of time like the steps. The model runner calls it on the loop thread, before the step
whose prompt chunk first reaches a sequence's images, and keeps the soft tokens with the
sequence (``runtime.multimodal.inputs.SequenceImages``).
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


class ImageEncoder:
    """Owns the encoder's weights on device and its compiled batch sizes."""

    def __init__(
        self,
        spec: VisionSpec,
        config: Any,
        weights: VisionWeights,
        processor: ImageProcessor,
    ) -> None:
        self.config = config
        self.weights = weights
        self.processor = processor
        self.batch_sizes = geometric(1, max(1, processor.max_images), 2)
        self._encode = jax.jit(functools.partial(spec.encode, config))
        self.compiled = CompiledShapes("image encoder", self._lower)

    @property
    def tokens_per_image(self) -> int:
        return self.processor.tokens_per_image

    def keys(self) -> list[int]:
        """The batch sizes to compile."""
        return list(self.batch_sizes)

    def _lower(self, num_images: int) -> Any:
        size = self.config.image_size
        pixels = jax.ShapeDtypeStruct((num_images, 3, size, size), np.float32)
        return self._encode.lower(self.weights, pixels)

    def encode(self, images: tuple[ImageInput, ...]) -> np.ndarray:
        """Soft tokens ``[num_images, tokens_per_image, text_hidden]`` float32 of ``images``,
        in batches of the compiled sizes (padded with zero images, whose output is dropped)."""
        out = []
        largest = self.batch_sizes[-1]
        for first in range(0, len(images), largest):
            group = images[first : first + largest]
            bucket = pick(self.batch_sizes, len(group))
            pixels = np.zeros((bucket, *group[0].pixels.shape), np.float32)
            for i, image in enumerate(group):
                pixels[i] = image.pixels
            soft = self.compiled.get(bucket)(self.weights, pixels)
            out.append(np.asarray(soft, np.float32)[: len(group)])
        return np.concatenate(out)
