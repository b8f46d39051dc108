"""Image bytes to pixels: hostile inputs are refused in bounded time, and the pixels equal
transformers' Gemma 3 and Pixtral (Mistral 3) image processors' for odd sizes and modes; the
runs of image tokens found in a prompt."""

from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from jax_llm_runtime.runtime.multimodal.decode import ImageError, decode_image
from jax_llm_runtime.runtime.multimodal.inputs import (
    SequenceImages,
    delimited_spans,
    image_spans,
)
from jax_llm_runtime.runtime.multimodal.pixtral import PixtralPreprocessing
from jax_llm_runtime.runtime.multimodal.processor import PixelPreprocessing
from tests.models import gemma3_vision_fixture as fx


def _encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def test_pixels_equal_transformers() -> None:
    images = fx.random_images(4, seed=3)
    transparent = Image.new("P", (29, 17))
    transparent.putpalette([i % 256 for i in range(768)])
    transparent.info["transparency"] = 5
    wide = Image.fromarray(np.random.default_rng(1).integers(0, 256, (9, 300, 3), np.uint8))
    images += [transparent, wide]
    expected = fx.hf_pixels(images)
    ours = PixelPreprocessing(size=fx.IMAGE_SIZE)
    for image, ref in zip(images, expected, strict=True):
        np.testing.assert_allclose(ours(image), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("longest_edge", "multiple"), [(40, 8), (112, 28), (1540, 28)])
def test_pixtral_pixels_equal_transformers(longest_edge: int, multiple: int) -> None:
    """Images smaller and larger than ``longest_edge``, of odd sizes and modes: resized keeping
    their aspect to multiples of the merged patch, as transformers' Pixtral processor does."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    rng = np.random.default_rng(5)
    images = fx.random_images(4, seed=4)
    transparent = Image.new("P", (29, 17))
    transparent.putpalette([i % 256 for i in range(768)])
    transparent.info["transparency"] = 5
    images += [transparent]
    for h, w in ((9, 300), (301, 127), (1000, 1713), (57, 57)):
        images.append(Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)))
    hf = PixtralImageProcessorPil(
        size={"longest_edge": longest_edge}, patch_size={"height": multiple, "width": multiple}
    )
    ours = PixtralPreprocessing(longest_edge=longest_edge, multiple=multiple)
    for image in images:
        ref = hf(image, return_tensors="np")["pixel_values"][0]
        got = ours(image)
        assert got.shape == ref.shape and got.shape[1] % multiple == got.shape[2] % multiple == 0
        assert max(got.shape[1:]) <= ours.max_side
        np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)


def test_delimited_spans() -> None:
    """Runs of ``[IMG]`` (9), ``[IMG_BREAK]`` (8) and ``[IMG_END]`` (7), each ending at its end
    token, also where two images touch."""
    ids = [1, 9, 9, 8, 9, 9, 7, 2, 9, 7, 9, 8, 9, 7, 3]
    assert delimited_spans(ids, (9, 8, 7), 7) == [(1, 7), (8, 10), (10, 14)]
    assert delimited_spans([1, 2], (9, 8, 7), 7) == delimited_spans([], (9, 8, 7), 7) == []
    with pytest.raises(ValueError, match="end token"):
        delimited_spans([1, 9, 8, 2], (9, 8, 7), 7)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_decodes_formats(fmt: str) -> None:
    image = fx.random_images(1)[0]
    decoded = decode_image(_encoded(image, fmt))
    assert decoded.size == image.size


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` and whose data is a few bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


HOSTILE = {
    "empty": b"",
    "not an image": b"hello, this is text and not a picture",
    "bmp": _encoded(Image.new("RGB", (4, 4)), "BMP"),
    "truncated png": _encoded(fx.random_images(1)[0], "PNG")[:60],
    "truncated jpeg": _encoded(fx.random_images(1)[0], "JPEG")[:200],
    "bomb 20000x20000": _png_header_only(20000, 20000),  # past Pillow's own limit
    "bomb 9000x9000": _png_header_only(9000, 9000),  # under Pillow's, over ours
    "side too long": _png_header_only(40000, 1),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_images_are_refused_quickly(name: str) -> None:
    started = time.monotonic()
    with pytest.raises(ImageError) as caught:
        decode_image(HOSTILE[name])
    if name == "bomb 9000x9000":
        assert "at most 25000000 are accepted" in str(caught.value)
    assert time.monotonic() - started < 1.0


def test_image_spans_and_safe_chunk_ends() -> None:
    ids = [1, 2, 9, 9, 9, 3, 9, 9, 9, 4]
    spans = image_spans(ids, 9, 3)
    assert spans == [(2, 5), (6, 9)]
    with pytest.raises(ValueError, match="image tokens in a row"):
        image_spans([9, 9, 1], 9, 3)
    fake = SequenceImages((object(), object()), tuple(spans))  # type: ignore[arg-type]
    assert fake.safe_end(0, 4) == 2  # back to the image's start
    assert fake.safe_end(2, 4) == 5  # a chunk from the image's start takes it whole
    assert fake.safe_end(0, 5) == 5 and fake.safe_end(5, 7) == 6
    assert fake.overlapping(4, 7) == [0, 1]
    causal = SequenceImages((object(), object()), tuple(spans), bidirectional=False)  # type: ignore[arg-type]
    assert causal.safe_end(0, 4) == 4 and causal.safe_end(2, 4) == 4  # cut like text
