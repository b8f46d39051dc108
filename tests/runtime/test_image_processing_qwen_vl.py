"""Qwen3-VL's images: pixels equal transformers' Qwen2-VL image processor's (its Pillow backend)
for odd sizes and modes, each image's ``<|image_pad|>`` count is ``Qwen3VLProcessor``'s, and
the runs of image tokens are found in a prompt with their merged patch grids."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from jax_llm_runtime.runtime.multimodal.inputs import ImageInput
from jax_llm_runtime.runtime.multimodal.processor import ImageProcessor
from jax_llm_runtime.runtime.multimodal.qwen_vl import (
    IMAGE_PAD,
    MAX_PIXELS,
    QwenVLPreprocessing,
    image_runs,
    qwen3_vl_processor,
)

PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS_TINY = 256, 1024  # 4 to 16 merged patches of 8x8 pixels
VISION_START, VISION_END, PAD_ID = 9, 10, 11


def _tiny() -> QwenVLPreprocessing:
    return QwenVLPreprocessing(PATCH, MERGE, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS_TINY)


def _hf_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS_TINY},
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )


def _unpatchify(patches: np.ndarray, grid_h: int, grid_w: int) -> np.ndarray:
    """HF's ``[grid_h * grid_w, C * T * P * P]`` patches, in merge-window order, back to
    ``[C, grid_h * P, grid_w * P]`` (temporal frame 0: an image is its frame repeated)."""
    m, p = MERGE, PATCH
    windows = patches.reshape(grid_h // m, grid_w // m, m, m, 3, TEMPORAL, p, p)
    np.testing.assert_array_equal(windows[..., 0, :, :], windows[..., 1, :, :])
    return windows[..., 0, :, :].transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, grid_h * p, grid_w * p)


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(7)

    def rgb(height: int, width: int) -> Image.Image:
        return Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8))

    rgba = Image.fromarray(rng.integers(0, 256, (23, 31, 4), np.uint8), "RGBA")
    png = io.BytesIO()
    rgba.save(png, format="PNG")
    gray = Image.fromarray(rng.integers(0, 256, (41, 19), np.uint8), "L")
    # (height, width): 37x53 and 20x300 shrink to max_pixels, 5x7 grows to min_pixels, 20x30
    # keeps its area, 5x1000 (aspect 200) shrinks with its short side clamped to a merged patch
    sizes = ((37, 53), (20, 300), (5, 7), (20, 30), (5, 1000), (1000, 5))
    return [rgb(h, w) for h, w in sizes] + [Image.open(io.BytesIO(png.getvalue())), gray]


def test_pixels_equal_transformers(processor: ImageProcessor) -> None:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    hf, ours = _hf_processor(), _tiny()
    for image in _images():
        ref = hf(image, return_tensors="np")
        (t, grid_h, grid_w) = ref["image_grid_thw"][0]
        got = ours(image)
        assert t == 1 and got.shape == (3, grid_h * PATCH, grid_w * PATCH), image.size
        assert ours.output_size(image.height, image.width) == tuple(got.shape[1:])
        np.testing.assert_allclose(
            got, _unpatchify(ref["pixel_values"], grid_h, grid_w), atol=1e-6, rtol=0
        )
        # HF's expansion of the image's <|image_pad|> (the processor's own method)
        hf_text = Qwen3VLProcessor.replace_image_token(
            SimpleNamespace(image_processor=hf, image_token=IMAGE_PAD), ref, 0
        )
        assert processor.expand(IMAGE_PAD, [processor.preprocess(image)]) == hf_text
        assert hf_text.count(IMAGE_PAD) == grid_h * grid_w // MERGE**2


def test_max_patches_bounds_every_size() -> None:
    """No image, of any size and aspect the processor accepts, has more patches than
    ``max_patches`` (past ``max_pixels`` where a short side is clamped to a merged patch)."""
    ours = _tiny()
    largest = 0
    for height in range(1, 40):
        for width in range(height, min(200 * height, 1500) + 1):
            h, w = ours.output_size(height, width)
            assert h % 8 == w % 8 == 0 and h * w >= 64
            largest = max(largest, h * w // PATCH**2)
    assert largest > MAX_PIXELS_TINY // PATCH**2  # the clamped case
    assert largest == ours.max_patches  # the bound is reached here


def test_aspect_ratio_over_200_is_refused() -> None:
    ours = _tiny()
    assert ours.output_size(1, 200) == ours.output_size(200, 1)[::-1]
    with pytest.raises(ValueError, match=r"aspect ratio \(201x1 pixels\)"):
        ours.output_size(1, 201)
    with pytest.raises(ValueError, match="aspect ratio"):
        ours(Image.new("RGB", (3, 700)))
    with pytest.raises(ValueError, match="aspect ratio"):  # as transformers refuses it
        _hf_processor()(Image.new("RGB", (3, 700)))


def _token_id(text: str) -> int:
    ids = {"<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END, IMAGE_PAD: PAD_ID}
    return ids[text]


def _vision(patch_size: int = PATCH, image_token_id: int = PAD_ID) -> SimpleNamespace:
    return SimpleNamespace(
        patch_size=patch_size, spatial_merge_size=MERGE, image_token_id=image_token_id
    )


@pytest.fixture
def processor(tmp_path: Path) -> ImageProcessor:
    """The tiny settings' processor, from a folder with the older min/max_pixels keys."""
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS_TINY, "patch_size": PATCH})
    )
    return qwen3_vl_processor(tmp_path, _vision(), _token_id, 4)


def _prompt(*pads: int) -> list[int]:
    ids = [1, 2]
    for n in pads:
        ids += [VISION_START] + [PAD_ID] * n + [VISION_END, 3]
    return ids


def test_locate_spans_and_grids(processor: ImageProcessor) -> None:
    assert processor.pixels == _tiny()
    wide = processor.preprocess(Image.new("RGB", (300, 20)))  # 8x120 pixels: 1x15 merged
    small = processor.preprocess(Image.new("RGB", (7, 5)))  # 16x24: 2x3
    assert wide.pixels.shape == (3, 8, 120) and small.pixels.shape == (3, 16, 24)
    text = processor.expand(
        f"a<|vision_start|>{IMAGE_PAD}<|vision_end|>b{IMAGE_PAD}", [wide, small]
    )
    assert text.count(IMAGE_PAD) == 15 + 6
    ids = _prompt(15, 6)
    found = processor.locate(ids, (wide, small))
    assert found.spans == ((3, 18), (21, 27)) and found.grids == ((1, 15), (2, 3))
    assert not found.bidirectional and found.soft_index is None
    assert processor.locate([1, 2, 3], ()) is None
    with pytest.raises(ValueError, match="image 1 is 6"):
        processor.locate(_prompt(15, 5), (wide, small))
    with pytest.raises(ValueError, match="tokens for 1 images, the request sends 2"):
        processor.locate(_prompt(15), (wide, small))
    with pytest.raises(ValueError, match="tokens for 1 images, the request sends 0"):
        processor.locate(_prompt(4), ())
    with pytest.raises(ValueError, match="sides multiples of 8"):
        processor.locate(_prompt(4), (ImageInput.of(np.zeros((3, 12, 16), np.float32)),))
    with pytest.raises(ValueError, match="at most"):
        processor.locate(_prompt(4), (ImageInput.of(np.zeros((3, 8, 8 * 1000), np.float32)),))


def test_image_runs() -> None:
    assert image_runs([1, 11, 11, 2, 11, 3], 11, [2, 1]) == [(1, 3), (4, 5)]
    assert image_runs([], 11, []) == []
    with pytest.raises(ValueError, match="2 image tokens in a row at position 1; image 0 is 3"):
        image_runs([1, 11, 11, 2], 11, [3])


def test_published_config_is_capped(tmp_path: Path) -> None:
    """Qwen3-VL's published settings, ``max_pixels`` capped at ``MAX_PIXELS``; the tokenizer's
    ``<|image_pad|>`` must be the model's image token."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    published = {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "processor_class": "Qwen3VLProcessor",
    }  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(published))
    processor = qwen3_vl_processor(tmp_path, _vision(16), _token_id, 4)
    pixels = processor.pixels
    assert (pixels.min_pixels, pixels.max_pixels) == (65536, MAX_PIXELS)
    assert pixels.max_patches == MAX_PIXELS // 16**2
    assert pixels.output_size(1024, 1024) == (1024, 1024)
    for height, width in ((4000, 3000), (77, 5000), (20, 30), (16000, 16000)):
        assert pixels.output_size(height, width) == smart_resize(
            height, width, 32, 65536, MAX_PIXELS
        )
    assert processor.tokens.max_patches == pixels.max_patches
    uncapped = QwenVLPreprocessing.from_hf(published, 16, 2)
    assert uncapped.max_pixels == 16777216 and uncapped.max_patches == 65536
    with pytest.raises(ValueError, match="image_token_id is 12"):
        qwen3_vl_processor(tmp_path, _vision(16, image_token_id=12), _token_id, 4)
    with pytest.raises(ValueError, match="patch_size is 16, the vision encoder's is 14"):
        QwenVLPreprocessing.from_hf(published, 14, 2)
