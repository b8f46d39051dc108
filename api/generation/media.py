"""Image URLs of a request to image bytes, under the operator's policy (``MediaConfig``).

- ``data:image/...;base64,...``: always accepted; decoded with a strict base64 check, its size
  bounded before decoding.
- ``http://`` and ``https://``: only for hosts in ``--allowed-media-domains`` (none by default),
  fetched with a timeout, a size cap read as the body streams, and no redirects followed (a
  redirect could leave the allowed hosts).
- ``file://``: only under ``--allowed-local-media-path`` (off by default), after resolving
  symbolic links, and only regular files within the size cap.

Anything else, or a failure of any of these, is a 400 naming the content part, so a client's
bad image never reaches the engine.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from jax_llm_runtime.api.protocol.bodies import ChatMessage, ImageContentPart
from jax_llm_runtime.api.protocol.errors import APIError, bad_request
from jax_llm_runtime.api.service.settings import MediaConfig
from jax_llm_runtime.runtime.multimodal.decode import ImageError, decode_image
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput
from jax_llm_runtime.runtime.multimodal.processor import ImageProcessor

IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")


def _refused(message: str, param: str) -> APIError:
    return bad_request(message, param=param, code="invalid_image")


async def image_bytes(url: str, media: MediaConfig, param: str) -> bytes:
    """The bytes ``url`` names (a 400 naming ``param`` when it cannot be used)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, media.max_image_bytes, param)
    if scheme in ("http", "https"):
        return await _fetch(url, media, param)
    if scheme == "file":
        return await asyncio.to_thread(_local_file, url, media, param)
    raise _refused("an image URL must be a data:, http(s): or file: URL", param)


def _data_url(url: str, max_bytes: int, param: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise _refused("a data URL needs a comma before its data", param)
    kind = head.removeprefix("data:").split(";")
    if kind[0].lower() not in IMAGE_MEDIA_TYPES or "base64" not in (p.lower() for p in kind[1:]):
        raise _refused(
            "a data URL must be base64 of a PNG, JPEG, WebP or GIF image "
            "(data:image/png;base64,...)",
            param,
        )
    if len(payload) * 3 // 4 > max_bytes:
        raise _refused(f"the image is larger than {max_bytes} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refused("the data URL's base64 is malformed", param) from None


async def _fetch(url: str, media: MediaConfig, param: str) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if not host or host not in media.allowed_domains:
        raise _refused(
            f"images are not fetched from {host or 'this URL'}; the server fetches only from "
            "the hosts of --allowed-media-domains (send the image as a data: URL instead)",
            param,
        )
    try:
        # The whole fetch has one deadline: httpx's timeout bounds each read, not a slow drip.
        return await asyncio.wait_for(_get(url, media, param), media.fetch_timeout_s)
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        raise _refused(f"the image could not be fetched: {type(exc).__name__}", param) from None


async def _get(url: str, media: MediaConfig, param: str) -> bytes:
    async with (
        httpx.AsyncClient(follow_redirects=False, timeout=media.fetch_timeout_s) as client,
        client.stream("GET", url) as response,
    ):
        if response.status_code != 200:
            raise _refused(f"fetching the image answered HTTP {response.status_code}", param)
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > media.max_image_bytes:
                raise _refused(f"the image is larger than {media.max_image_bytes} bytes", param)
        return bytes(body)


def _local_file(url: str, media: MediaConfig, param: str) -> bytes:
    if media.allowed_local_path is None:
        raise _refused(
            "file: image URLs are off; the server reads local files only under "
            "--allowed-local-media-path",
            param,
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _refused("a file: URL must name a local path (file:///...)", param)
    root = Path(media.allowed_local_path).resolve()
    try:
        path = Path(unquote(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise _refused("the image file does not exist", param) from None
    if not path.is_relative_to(root) or not path.is_file():
        raise _refused(f"the image file is not a file under {root}", param)
    if path.stat().st_size > media.max_image_bytes:
        raise _refused(f"the image is larger than {media.max_image_bytes} bytes", param)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as file:
        data = file.read(media.max_image_bytes + 1)
    if len(data) > media.max_image_bytes:
        raise _refused(f"the image is larger than {media.max_image_bytes} bytes", param)
    return data


async def request_images(
    messages: list[ChatMessage], processor: ImageProcessor | None, media: MediaConfig
) -> tuple[ImageInput, ...]:
    """The images of a chat's messages, in order, fetched, decoded and preprocessed for the
    model (``processor``: None for a model that takes no images); a 400 naming the content part
    of the first one that cannot be used."""
    parts = [
        (f"messages[{i}].content[{j}]", message.role, part.image_url.url)
        for i, message in enumerate(messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if isinstance(part, ImageContentPart)
    ]
    if not parts:
        return ()
    first = parts[0][0]
    if processor is None:
        raise bad_request("this model does not accept images", param=first, code="invalid_image")
    if len(parts) > processor.max_images:
        raise bad_request(
            f"the request holds {len(parts)} images; at most {processor.max_images} per prompt "
            "(--limit-mm-per-prompt)",
            param=first,
            code="invalid_image",
        )
    images = []
    for param, role, url in parts:
        if role != "user":
            raise _refused("images are accepted in user messages only", param)
        data = await image_bytes(url, media, param)
        images.append(await asyncio.to_thread(_preprocessed, data, processor, param))
    return tuple(images)


def _preprocessed(data: bytes, processor: ImageProcessor, param: str) -> ImageInput:
    try:
        return processor.preprocess(decode_image(data))
    except ImageError as exc:
        raise _refused(str(exc), param) from None
