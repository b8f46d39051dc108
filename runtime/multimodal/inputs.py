"""What a request's images are to the engine: preprocessed pixels with a digest
(``ImageInput``), and per sequence where its image tokens sit and their soft tokens once the
encoder ran (``SequenceImages``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image, preprocessed for the model's encoder."""

    pixels: np.ndarray  # [3, size, size] float32
    digest: bytes  # SHA-256 of the pixels: the prefix cache's key for the image

    @classmethod
    def of(cls, pixels: np.ndarray) -> ImageInput:
        pixels = np.ascontiguousarray(pixels, np.float32)
        h = hashlib.sha256(repr(pixels.shape).encode())
        h.update(pixels.tobytes())
        return cls(pixels, h.digest())


def image_spans(
    prompt_ids: list[int], image_token_id: int, tokens_per_image: int
) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of image tokens in the prompt, in order; a ValueError when a
    run is not one image's tokens long."""
    ids = np.asarray(prompt_ids)
    is_image = ids == image_token_id
    starts = np.flatnonzero(is_image & ~np.concatenate([[False], is_image[:-1]]))
    ends = np.flatnonzero(is_image & ~np.concatenate([is_image[1:], [False]])) + 1
    spans = [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]
    for start, end in spans:
        if end - start != tokens_per_image:
            raise ValueError(
                f"the prompt holds {end - start} image tokens in a row at position {start}; "
                f"one image is {tokens_per_image}"
            )
    return spans


@dataclass(eq=False)
class SequenceImages:
    """A sequence's images: ``spans[i]`` holds ``images[i]``'s soft tokens in the prompt.
    ``embeds`` are the encoder's output, computed once, the first time a chunk reaches an
    image, and kept (on the host) until the sequence ends, so a preempted sequence is
    recomputed with the same soft tokens without running the encoder again."""

    images: tuple[ImageInput, ...]
    spans: tuple[tuple[int, int], ...]
    embeds: np.ndarray | None = field(default=None, repr=False)  # [num_images, tokens, hidden]

    def __post_init__(self) -> None:
        if len(self.images) != len(self.spans):
            raise ValueError(
                f"the prompt holds image tokens for {len(self.spans)} images, the request "
                f"sends {len(self.images)}"
            )

    def overlapping(self, start: int, stop: int) -> list[int]:
        """Indices of the images whose tokens intersect positions ``[start, stop)``."""
        return [i for i, (a, b) in enumerate(self.spans) if a < stop and start < b]

    def safe_end(self, start: int, stop: int) -> int:
        """``stop`` moved so that no image's tokens are cut, since the tokens of one image
        attend to each other both ways and so must be computed in one step: back to the start
        of an image it would cut, or, when that leaves nothing (the chunk starts inside the
        image or at it), on to the image's end."""
        for a, b in self.spans:
            if a < stop < b:
                return a if a > start else b
        return stop

    def digests(self, start: int, stop: int) -> list[bytes]:
        """The digests of the images whose tokens intersect ``[start, stop)``."""
        return [self.images[i].digest for i in self.overlapping(start, stop)]
