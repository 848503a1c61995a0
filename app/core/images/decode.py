"""Decode and validate one uploaded image: format, size from the header, EXIF orientation, mode.

The pixel count is checked from the header before any pixel data is decoded, so a decompression
bomb costs a header parse. The result is an RGB or L image, as the model's channels require.

A JPEG at least twice the size the model resizes to (on its shorter side) can be decoded at 1/2, 1/4 or
1/8 scale inside libjpeg (DCT-domain scaling, PIL's `draft`): the smallest scale whose shorter side is
still at least that size. A 12-megapixel phone photo then costs about a fifth of a full decode.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from app.core.contract.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType

SUPPORTED_FORMATS: dict[str, str] = {
    "JPEG": "image/jpeg",
    "PNG": "image/png",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
    "GIF": "image/gif",
}
SUPPORTED_TYPES = ", ".join(sorted(set(SUPPORTED_FORMATS.values())))

# Our own check below is the guard; PIL's bomb check would fire later and with a different error.
Image.MAX_IMAGE_PIXELS = None


def decode_image(
    data: bytes, filename: str, channels: int, max_pixels: int, draft_to: int | None = None
) -> Image.Image:
    """Bytes of a JPEG, PNG, WebP, BMP or GIF (first frame) -> upright RGB (channels=3) or L image; a large
    JPEG scaled while decoding when `draft_to` (the side the image is resized to next) is given."""
    return load_image(open_image(data, filename, max_pixels), filename, channels, draft_to)


def open_image(data: bytes | memoryview, filename: str, max_pixels: int) -> Image.Image:
    """The image's header, read and checked (format, pixel count); no pixel data is decoded yet."""
    if not data:
        raise InvalidInput(f"{filename}: the file is empty; send the image bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=None)
    except UnidentifiedImageError:
        raise UnsupportedMediaType(f"{filename}: not a recognised image; send one of {SUPPORTED_TYPES}") from None
    except Exception as e:  # a malformed header can raise many things inside PIL's plugins
        raise InvalidInput(f"{filename}: could not read the image header ({e})") from None
    if image.format not in SUPPORTED_FORMATS:
        raise UnsupportedMediaType(
            f"{filename}: {image.format} images are not supported; send one of {SUPPORTED_TYPES}"
        )
    width, height = image.size
    if width * height > max_pixels:
        raise PayloadTooLarge(
            f"{filename}: {width}x{height} = {width * height} pixels is over the limit of {max_pixels}; resize it first"
        )
    if width < 1 or height < 1:
        raise InvalidInput(f"{filename}: the image has no pixels ({width}x{height})")
    return image


def load_image(image: Image.Image, filename: str, channels: int, draft_to: int | None = None) -> Image.Image:
    """An opened image's pixels (its first frame), upright, as RGB (channels=3) or L; with `draft_to`, a
    JPEG whose shorter side is at least twice that is decoded at the smallest scale that keeps it at least
    `draft_to` (see the module's note)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL warns on odd EXIF and palette transparency
            if draft_to is not None and image.format == "JPEG" and min(image.size) >= 2 * draft_to:
                image.draft(image.mode, (draft_to, draft_to))  # libjpeg keeps both sides >= draft_to
            image.seek(0)  # first frame of an animation
            image.load()
            upright: Image.Image = ImageOps.exif_transpose(image) or image
            return to_mode(upright, channels)
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, ZeroDivisionError) as e:
        raise InvalidInput(f"{filename}: the image data is truncated or corrupted ({e})") from None


def to_mode(image: Image.Image, channels: int) -> Image.Image:
    """Any PIL mode -> RGB or L: 16-bit scaled to 8-bit, transparency composited over white."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(image, dtype=np.float64)
        scale = 65535.0 if image.mode.startswith("I;16") or a.max(initial=0) > 255 else 255.0
        image = Image.fromarray(np.clip(a / scale * 255.0 + 0.5, 0, 255).astype(np.uint8))
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return image.convert("RGB" if channels == 3 else "L")
