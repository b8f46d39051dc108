"""Images in chat requests, served by a tiny Mistral 3 vision-language model: the OpenAI SDK's
two base64 images of different sizes give HF's greedy reply, and ``usage`` counts each image's
grid of tokens; a placeholder typed into the text is a 400."""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from jax_llm_runtime.api.app import create_app
from tests.api.conftest import assert_error
from tests.api.inprocess import serve_in_thread
from tests.models import mistral3_vision_fixture as fx
from tests.models.gemma3_vision_fixture import random_images

NEW_TOKENS = 6


def _data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


ENGINE = dict(
    max_num_seqs=2, max_model_len=128, dtype="float32", page_size=8, kvcache_mem_mb=1,
    precompile="none",
)  # fmt: skip


@contextlib.contextmanager
def _served(folder: Path) -> Iterator[str]:
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    engine = build_engine(EngineConfig(model_id=str(folder), **ENGINE))
    with serve_in_thread(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def server(mistral3_vision_checkpoint) -> Iterator[tuple]:
    folder, hf_model = mistral3_vision_checkpoint
    with _served(folder) as url:
        yield url, hf_model, folder


def _image_part(image: Image.Image) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": _data_url(image)}}


def test_openai_sdk_sends_images_of_two_sizes(server) -> None:
    _check_two_images(*server)


def test_prepared_checkpoint_keeps_the_image_encoder(mistral3_vision_checkpoint, tmp_path):
    """Prepared (``--save-prepared``: orbax), the model keeps its image encoder and processor
    settings: served from the prepared folder, the same images give HF's reply."""
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.prepared import save_prepared

    folder, hf_model = mistral3_vision_checkpoint
    prepared = save_prepared(EngineConfig(model_id=str(folder), **ENGINE), tmp_path / "p")
    with _served(prepared) as url:
        _check_two_images(url, hf_model, folder)


def _check_two_images(url: str, hf_model: Any, folder: Path) -> None:
    from transformers import AutoTokenizer

    images = random_images(2, seed=7)  # 37 x 23 and 50 x 61: other grids
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="any",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    _image_part(images[0]),
                    {"type": "text", "text": "with"},
                    _image_part(images[1]),
                ],
            }
        ],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pixels = fx.hf_pixels(images)
    grids = [tokenizer.decode(fx.image_sequence(p)) for p in pixels]
    # The template's newline follows a block tag, which chat templates trim.
    text = f"<s>[user]Compare{grids[0]}with{grids[1]}[model]"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(fx.IMG_ID) == sum(p.shape[1] * p.shape[2] // 64 for p in pixels)
    assert reply.usage.prompt_tokens == len(ids)  # every image token is counted
    expected = fx.hf_greedy(hf_model, ids, pixels, NEW_TOKENS)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_typed_placeholder_is_a_400(server) -> None:
    url, _, _ = server
    content = [{"type": "text", "text": fx.IMG}, _image_part(random_images(1)[0])]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert_error(response, 400, param="messages")
