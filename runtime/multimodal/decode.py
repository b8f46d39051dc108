"""Untrusted image bytes to a Pillow image, in bounded time and memory.

Only PNG, JPEG, WebP and GIF (its first frame) are opened. The header gives the size, which is
checked before any pixel is decoded, so a small file that claims 20000 x 20000 pixels (a
decompression bomb) is refused without allocating them; a truncated or corrupt file fails while
it decodes. Every failure is an ``ImageError`` (a ``ValueError``) whose message can go back to
the client as it is.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# The largest image decoded: 25 megapixels (75 MB as RGB), a 6000 x 4000 photo and more. What
# the model sees is resized to its input size anyway.
MAX_PIXELS = 25_000_000
MAX_SIDE = 16_384


class ImageError(ValueError):
    """An image that cannot be used: not an image, an unsupported format, too large, corrupt."""


def decode_image(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The decoded image of ``data`` (its first frame), fully loaded; or ``ImageError``."""
    if not data:
        raise ImageError("the image is empty")
    try:
        with warnings.catch_warnings():
            # Pillow warns (and past twice its limit raises) on huge sizes; our check is first.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width < 1 or height < 1 or max(width, height) > MAX_SIDE:
                raise ImageError(f"the image's size {width}x{height} is not supported")
            if width * height > max_pixels:
                raise ImageError(
                    f"the image has {width}x{height} pixels; at most {max_pixels} are accepted"
                )
            image.load()
    except ImageError:
        raise
    except Image.UnidentifiedImageError:
        formats = ", ".join(FORMATS)
        raise ImageError(f"the data is not an image in a supported format ({formats})") from None
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the image could not be decoded: {exc}") from None
    return image
