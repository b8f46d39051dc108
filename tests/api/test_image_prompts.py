"""A chat with images becomes the prompt ids and pixels that transformers' ``Gemma3Processor``
makes of it (its chat template, placeholder expansion and image processor)."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import msgspec
import numpy as np
import pytest

from jax_llm_runtime.api.generation.prompts import chat_prompt
from jax_llm_runtime.api.protocol.bodies import ChatCompletionRequest
from jax_llm_runtime.models.families.gemma3_vision import gemma3_vision_config_from_hf
from jax_llm_runtime.runtime.multimodal.processor import gemma3_processor
from jax_llm_runtime.runtime.text.tokenizer import Tokenizer
from tests.models import gemma3_vision_fixture as fx


def _data_url(image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_prompt_and_pixels_equal_gemma3_processor(tmp_path: Path) -> None:
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    fx.save_tokenizer(tmp_path)
    images = fx.random_images(3, seed=4)[1:]  # RGBA and L
    turns = [
        {"role": "user", "content": [
            {"type": "text", "text": "Compare"}, {"type": "image", "url": _data_url(images[0])},
            {"type": "text", "text": "with"}, {"type": "image", "url": _data_url(images[1])},
        ]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": "How?"},
    ]  # fmt: skip
    hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(
        tmp_path, extra_special_tokens={"boi_token": fx.BOI, "eoi_token": fx.EOI,
                                        "image_token": fx.IMAGE},
    )  # fmt: skip
    image_processor = Gemma3ImageProcessorPil(
        size={"height": fx.IMAGE_SIZE, "width": fx.IMAGE_SIZE}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )  # fmt: skip
    hf = Gemma3Processor(image_processor, hf_tokenizer, fx.CHAT_TEMPLATE, fx.TOKENS_PER_IMAGE)
    text = hf.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    expected = hf(text=text, images=images, return_tensors="np")

    ours_tokenizer = Tokenizer.from_pretrained_dir(tmp_path)
    vision = gemma3_vision_config_from_hf(fx.hf_config().to_dict())
    processor = gemma3_processor(
        None, vision, lambda i: ours_tokenizer.decode([i], skip_special_tokens=False), 4
    )

    def part(p: dict) -> dict:
        if p["type"] == "image":
            return {"type": "image_url", "image_url": {"url": p["url"]}}
        return p

    messages = [
        {**t, "content": t["content"] if isinstance(t["content"], str) else
         [part(p) for p in t["content"]]}
        for t in turns
    ]  # fmt: skip
    body = msgspec.convert({"messages": messages}, ChatCompletionRequest)
    prompt = asyncio.run(chat_prompt(ours_tokenizer, body, None, processor))
    assert prompt.ids == expected["input_ids"][0].tolist()
    pixels = np.stack([image.pixels for image in prompt.images])
    np.testing.assert_allclose(pixels, expected["pixel_values"], atol=1e-6, rtol=0)


def test_image_flags() -> None:
    from jax_llm_runtime.api.cli.serve import _config_from_args, build_parser
    from jax_llm_runtime.api.cli.service_flags import server_config

    parser = build_parser()
    for value, limit in (("3", 3), ('{"image": 7}', 7), ("0", 0)):
        assert (
            _config_from_args(
                parser.parse_args(["--limit-mm-per-prompt", value])
            ).limit_mm_per_prompt
            == limit
        )
    for bad in ('{"video": 1}', "-1", "many", "{"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--limit-mm-per-prompt", bad])
    args = parser.parse_args(
        ["--allowed-media-domains", "Images.Example.com", "cdn.example.org",
         "--allowed-local-media-path", "/srv/images", "--max-image-bytes", "1000"]
    )  # fmt: skip
    media = server_config(args).media
    assert media.allowed_domains == ("images.example.com", "cdn.example.org")
    assert (media.allowed_local_path, media.max_image_bytes) == ("/srv/images", 1000)
    assert server_config(parser.parse_args([])).media.allowed_domains == ()
