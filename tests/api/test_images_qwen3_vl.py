"""Images in chat requests, served by a tiny Qwen3-VL model: the OpenAI SDK's two base64 images
of different sizes give HF's greedy reply (the chat template's image placeholders expanded to
each image's grid, the multimodal rope's positions and the deepstack levels applied), and
``usage`` counts every image token; served from a prepared checkpoint too."""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
from PIL import Image

from jax_llm_runtime.api.app import create_app
from tests.api.inprocess import serve_in_thread
from tests.models import qwen3_vl_vision_fixture as fx
from tests.models.gemma3_vision_fixture import random_images

NEW_TOKENS = 6
ENGINE = dict(
    max_num_seqs=2, max_model_len=256, dtype="float32", page_size=8, kvcache_mem_mb=1,
    precompile="none",
)  # fmt: skip


def _image_part(image: Image.Image) -> dict[str, Any]:
    out = io.BytesIO()
    image.save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


@contextlib.contextmanager
def _served(folder: Path) -> Iterator[str]:
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    engine = build_engine(EngineConfig(model_id=str(folder), **ENGINE))
    with serve_in_thread(create_app(engine)) as url:
        yield url


def test_openai_sdk_sends_images_of_two_sizes(qwen3_vl_vision_checkpoint) -> None:
    folder, hf_model = qwen3_vl_vision_checkpoint
    with _served(folder) as url:
        _check_two_images(url, hf_model, folder)


def test_prepared_checkpoint_keeps_the_image_encoder(qwen3_vl_vision_checkpoint, tmp_path):
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.prepared import save_prepared

    folder, hf_model = qwen3_vl_vision_checkpoint
    prepared = save_prepared(EngineConfig(model_id=str(folder), **ENGINE), tmp_path / "p")
    with _served(prepared) as url:
        _check_two_images(url, hf_model, folder)


def _check_two_images(url: str, hf_model: Any, folder: Path) -> None:
    from transformers import AutoTokenizer

    images = random_images(2, seed=7)  # 37 x 23 and 50 x 61: other grids
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    content = [
        {"type": "text", "text": "Compare"},
        _image_part(images[0]),
        {"type": "text", "text": "with"},
        _image_part(images[1]),
    ]
    reply = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": content}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _, grids = fx.hf_patches(images)
    parts = [tokenizer.decode(fx.image_ids(grid)) for grid in grids]
    text = f"<|im_start|>user\nCompare{parts[0]}with{parts[1]}<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(fx.IMAGE_PAD_ID) == sum(int(g.prod()) // fx.MERGE**2 for g in grids)
    assert reply.usage.prompt_tokens == len(ids)  # every image token is counted
    expected = fx.hf_greedy(hf_model, ids, images, NEW_TOKENS)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_an_image_too_narrow_is_a_400(qwen3_vl_vision_checkpoint) -> None:
    """An aspect ratio over 200 (transformers' processor refuses it too) is a 400 naming the
    content part, and the server goes on."""
    import httpx

    from tests.api.conftest import assert_error

    folder, _ = qwen3_vl_vision_checkpoint
    narrow = Image.new("RGB", (402, 2), (200, 10, 10))
    content = [{"type": "text", "text": "what?"}, _image_part(narrow)]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    with _served(folder) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert_error(response, 400, param="messages[0].content[1]")
        assert "aspect ratio" in response.json()["error"]["message"]
        body["messages"][0]["content"] = "just text"
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
