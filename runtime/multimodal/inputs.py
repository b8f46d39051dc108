"""What a request's images are to the engine: preprocessed pixels with a digest
(``ImageInput``), and per sequence where its image tokens sit and their soft tokens once the
encoder ran (``SequenceImages``).

An image's tokens in a prompt are one run (its *span*). For Gemma 3 every token of the run
takes a soft token; for Mistral 3 the run is ``[IMG]`` tokens row by row with an
``[IMG_BREAK]`` after each row and ``[IMG_END]`` last, and only the ``[IMG]`` tokens take soft
tokens (``SequenceImages.soft_index``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image, preprocessed for the model's encoder."""

    pixels: np.ndarray  # [3, height, width] float32
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


def delimited_spans(
    prompt_ids: list[int], member_ids: tuple[int, ...], end_id: int
) -> list[tuple[int, int]]:
    """``[start, end)`` of each image's run in the prompt, in order: tokens of ``member_ids``
    in a row, each run ending at ``end_id`` (two images may touch); a ValueError when a run does
    not end with ``end_id``."""
    ids = np.asarray(prompt_ids)
    if ids.size == 0:
        return []
    member = np.isin(ids, member_ids)
    ends_run = member & ((ids == end_id) | ~np.concatenate([member[1:], [False]]))
    starts_run = member & ~np.concatenate([[False], member[:-1] & ~(ids[:-1] == end_id)])
    spans = [
        (int(s), int(e) + 1)
        for s, e in zip(np.flatnonzero(starts_run), np.flatnonzero(ends_run), strict=True)
    ]
    for start, end in spans:
        if ids[end - 1] != end_id:
            raise ValueError(
                f"the image tokens at position {start} do not end with the image end token"
            )
    return spans


@dataclass(eq=False)
class SequenceImages:
    """A sequence's images: ``spans[i]`` holds ``images[i]``'s tokens in the prompt, and
    ``soft_index[i]`` (None: every position of every span in turn) the soft token each position
    of the span takes (-1: none, the token keeps its embedding). ``embeds`` are the encoder's
    output, computed once, the first time a chunk reaches an image, and kept (on the host)
    until the sequence ends, so a preempted sequence is recomputed with the same soft tokens
    without running the encoder again. ``bidirectional``: the tokens of one image attend to
    each other both ways, so a chunk must not cut an image (else causally, like text)."""

    images: tuple[ImageInput, ...]
    spans: tuple[tuple[int, int], ...]
    embeds: Sequence[np.ndarray] | None = field(default=None, repr=False)  # [tokens, hidden] each
    soft_index: tuple[np.ndarray, ...] | None = field(default=None, repr=False)  # [span] int32
    bidirectional: bool = True
    # M-RoPE models (Qwen3-VL): each image's merged patch grid, (rows, columns); its span's
    # tokens are those patches row by row (``rope_positions``).
    grids: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if len(self.images) != len(self.spans):
            raise ValueError(
                f"the prompt holds image tokens for {len(self.spans)} images, the request "
                f"sends {len(self.images)}"
            )

    def overlapping(self, start: int, stop: int) -> list[int]:
        """Indices of the images whose tokens intersect positions ``[start, stop)``."""
        return [i for i, (a, b) in enumerate(self.spans) if a < stop and start < b]

    def soft_tokens(self, i: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """For prompt positions ``[lo, hi)`` inside image ``i``'s span: which take a soft token
        (``[hi - lo]`` bool) and those soft tokens, in order (``[taken, hidden]``)."""
        a = self.spans[i][0]
        if self.soft_index is None:
            index = np.arange(lo - a, hi - a)
        else:
            index = self.soft_index[i][lo - a : hi - a]
        take = index >= 0
        return take, np.asarray(self.embeds[i])[index[take]]

    def safe_end(self, start: int, stop: int) -> int:
        """``stop`` moved so that no image's tokens are cut when they attend to each other both
        ways and so must be computed in one step: back to the start of an image it would cut,
        or, when that leaves nothing (the chunk starts inside the image or at it), on to the
        image's end. Causal image tokens are cut like text."""
        if not self.bidirectional:
            return stop
        for a, b in self.spans:
            if a < stop < b:
                return a if a > start else b
        return stop

    def rope_positions(self, start: int, stop: int) -> np.ndarray:  # [stop - start, 3] int32
        """Multimodal rope's (temporal, height, width) positions of ``[start, stop)`` (``grids``
        set; past the prompt too): an image's tokens share its first token's temporal position
        and count their patch's row and column from it; a text token's three are equal, and
        each image before it moves them by ``max(rows, columns) - rows * columns`` (the image
        takes ``max(rows, columns)`` positions, not one per token), as transformers'
        ``get_rope_index`` of Qwen3-VL."""
        assert self.grids is not None
        pos = np.arange(start, stop)
        out = np.repeat(pos[:, None], 3, axis=1)
        shift = 0
        for (a, b), (rows, cols) in zip(self.spans, self.grids, strict=True):
            if b - a != rows * cols:
                raise ValueError(f"an image of {rows}x{cols} tokens spans {b - a} positions")
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                k, first = np.arange(lo, hi) - a, a + shift
                out[lo - start : hi - start] = np.stack(
                    [np.full(hi - lo, first), first + k // cols, first + k % cols], axis=1
                )
            delta = max(rows, cols) - rows * cols
            out[pos >= b] += delta
            shift += delta
        return out.astype(np.int32)

    def digests(self, start: int, stop: int) -> list[bytes]:
        """The digests of the images whose tokens intersect ``[start, stop)``."""
        return [self.images[i].digest for i in self.overlapping(start, stop)]
