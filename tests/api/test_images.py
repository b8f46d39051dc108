"""Images in chat requests, served by a tiny Gemma 3 vision-language model: the OpenAI SDK's
base64 image gives HF's greedy reply and counts the image tokens in ``usage``; local files and
allowed hosts work; every hostile image is a 400 in the OpenAI envelope, quickly."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.service.settings import MediaConfig, ServerConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import assert_error
from tests.api.inprocess import serve_in_thread
from tests.models import gemma3_vision_fixture as fx
from tests.runtime.test_image_processing import HOSTILE

MAX_IMAGES = 2
MAX_IMAGE_BYTES = 256 * 1024
FETCH_TIMEOUT_S = 1.5
NEW_TOKENS = 6


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


class _Images(http.server.BaseHTTPRequestHandler):
    png = b""

    def do_GET(self) -> None:
        if self.path == "/ok.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.png)))
            self.end_headers()
            self.wfile.write(self.png)
        elif self.path in ("/big", "/slow"):
            size = 4 * MAX_IMAGE_BYTES if self.path == "/big" else 100
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if self.path == "/big":
                self.wfile.write(b"\0" * size)
            for _ in range(size if self.path == "/slow" else 0):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.1)  # each read well within the timeout, the whole far past it
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://example.com/x.png")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    _Images.png = _png(fx.random_images(1, seed=5)[0])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, image_host: str, gemma3_vision_checkpoint
) -> Iterator[tuple]:
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    folder, hf_model = gemma3_vision_checkpoint
    media_dir = tmp_path_factory.mktemp("media")
    engine = build_engine(
        EngineConfig(
            model_id=str(folder), max_num_seqs=2, max_model_len=96, dtype="float32",
            page_size=8, kvcache_mem_mb=1, limit_mm_per_prompt=MAX_IMAGES, precompile="none",
        )
    )  # fmt: skip
    media = MediaConfig(
        allowed_domains=("127.0.0.1",), allowed_local_path=str(media_dir),
        max_image_bytes=MAX_IMAGE_BYTES, fetch_timeout_s=FETCH_TIMEOUT_S,
    )  # fmt: skip
    config = ServerConfig(media=media)
    with serve_in_thread(create_app(engine, config=config)) as url:
        yield url, hf_model, media_dir, folder


def _chat(url: str, content: list[dict[str, Any]], role: str = "user") -> httpx.Response:
    body = {"messages": [{"role": role, "content": content}], "max_tokens": 2}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_openai_sdk_sends_a_base64_image(server) -> None:
    from transformers import AutoTokenizer

    url, hf_model, _, folder = server
    image = fx.random_images(1, seed=7)[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="any",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": _data_url(_png(image))}},
                ],
            }
        ],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # The fixture's template renders the image as <start_of_image>; Gemma3Processor expands it.
    image_text = f"\n\n{fx.BOI}{fx.IMAGE * fx.TOKENS_PER_IMAGE}{fx.EOI}\n\n"
    ids = tokenizer.encode(f"<s><user>What is this?{image_text}<model>", add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(ids)  # the image's soft tokens are counted
    pixels = fx.hf_pixels([Image.open(io.BytesIO(_png(image)))])
    expected = fx.hf_greedy(hf_model, ids, pixels, NEW_TOKENS)
    assert reply.usage.completion_tokens == NEW_TOKENS
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_local_files_and_allowed_hosts(server, image_host: str) -> None:
    url, _, media_dir, _ = server
    path = media_dir / "cat.png"
    path.write_bytes(_png(fx.random_images(1, seed=8)[0]))
    assert _chat(url, [_image_part(path.as_uri())]).status_code == 200
    assert _chat(url, [_image_part(f"{image_host}/ok.png")]).status_code == 200


def _hostile_parts(media_dir: Path, image_host: str) -> dict[str, list[dict[str, Any]]]:
    outside = media_dir.parent / "outside.png"
    outside.write_bytes(_png(fx.random_images(1)[0]))
    link = media_dir / "link.png"
    if not link.exists():
        link.symlink_to(outside)
    good = _image_part(_data_url(_png(fx.random_images(1)[0])))
    parts = {name: [_image_part(_data_url(data))] for name, data in HOSTILE.items()}
    parts |= {
        "too many images": [good] * (MAX_IMAGES + 1),
        "bad base64": [_image_part("data:image/png;base64,@@@@")],
        "not an image type": [_image_part(_data_url(b"hello", "text/plain"))],
        "host not allowed": [_image_part("https://example.com/cat.png")],
        "redirect": [_image_part(f"{image_host}/redirect")],
        "fetched too large": [_image_part(f"{image_host}/big")],
        "fetched slowly": [_image_part(f"{image_host}/slow")],
        "sent too large": [_image_part(_data_url(b"\0" * (MAX_IMAGE_BYTES + 3)))],
        "not found": [_image_part(f"{image_host}/missing.png")],
        "unreachable": [_image_part("http://127.0.0.1:9/cat.png")],
        "file outside": [_image_part(outside.as_uri())],
        "file symlink outside": [_image_part(link.as_uri())],
        "file missing": [_image_part((media_dir / "nope.png").as_uri())],
        "ftp": [_image_part("ftp://example.com/cat.png")],
    }
    return parts


def test_hostile_images_are_400s(server, image_host: str) -> None:
    url, _, media_dir, _ = server
    for name, parts in _hostile_parts(media_dir, image_host).items():
        started = time.monotonic()
        response = _chat(url, [{"type": "text", "text": "hi"}, *parts])
        assert time.monotonic() - started < 10, name
        error = assert_error(response, 400)
        assert error["param"].startswith("messages[0].content["), (name, error)


def test_malformed_parts_and_roles(server) -> None:
    url, _, _, _ = server
    good = _image_part(_data_url(_png(fx.random_images(1)[0])))
    assert_error(_chat(url, [good], role="assistant"), 400, param="messages[0].content[0]")
    for part in (
        {"type": "image_url"},
        {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"image_url": {"url": "data:image/png;base64,AAAA"}},
    ):
        assert_error(_chat(url, [part]), 400)
    # A placeholder typed into the text is one placeholder too many for the images sent.
    text = {"type": "text", "text": fx.BOI}
    assert_error(_chat(url, [text, good]), 400, param="messages")


def test_text_only_model_refuses_images() -> None:
    engine = MockEngine(token_delay_s=0)
    with serve_in_thread(create_app(engine)) as url:
        good = _image_part(_data_url(_png(fx.random_images(1)[0])))
        error = assert_error(_chat(url, [good]), 400, param="messages[0].content[0]")
        assert "does not accept images" in error["message"]


def test_one_image_two_encodings_one_digest() -> None:
    """The prefix cache keys an image by its preprocessed pixels."""
    from jax_llm_runtime.runtime.multimodal.inputs import ImageInput
    from jax_llm_runtime.runtime.multimodal.processor import PixelPreprocessing

    image = fx.random_images(1)[0]
    pixels = PixelPreprocessing(size=fx.IMAGE_SIZE)(Image.open(io.BytesIO(_png(image))))
    again = PixelPreprocessing(size=fx.IMAGE_SIZE)(image)
    assert ImageInput.of(pixels).digest == ImageInput.of(np.array(again)).digest


def test_responses_input_image(server) -> None:
    url, _, _, _ = server
    image = _data_url(_png(fx.random_images(1, seed=9)[0]))

    def respond(*parts: dict[str, Any]) -> httpx.Response:
        body = {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, *parts]}],
            "max_output_tokens": 2,
        }
        return httpx.post(f"{url}/v1/responses", json=body, timeout=60)

    response = respond({"type": "input_image", "image_url": image})
    assert response.status_code == 200, response.text
    text_only = respond()
    image_tokens = len(fx.image_sequence())
    assert (
        response.json()["usage"]["input_tokens"]
        == text_only.json()["usage"]["input_tokens"] + image_tokens
    )
    assert_error(respond({"type": "input_image", "image_url": _data_url(b"not a png")}), 400)
    assert_error(respond({"type": "input_image"}), 400)
