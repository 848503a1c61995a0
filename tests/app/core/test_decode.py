from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from app.core.decode import decode_image
from app.core.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from harness.images import encode, png_with_header

LIMIT = 10_000_000


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF"])
def test_supported_formats_decode_to_rgb(fmt: str) -> None:
    image = Image.new("RGB", (20, 10), (200, 30, 30))
    out = decode_image(encode(image, fmt), f"a.{fmt.lower()}", channels=3, max_pixels=LIMIT)
    assert out.mode == "RGB" and out.size == (20, 10)


def test_grayscale_model_gets_l() -> None:
    out = decode_image(encode(Image.new("RGB", (4, 4), "red")), "a.png", channels=1, max_pixels=LIMIT)
    assert out.mode == "L"


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), "blue")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    data = encode(image, "JPEG", exif=exif.tobytes())
    assert decode_image(data, "r.jpg", 3, LIMIT).size == (20, 40)


def test_sixteen_bit_png_is_scaled_not_clipped() -> None:
    a = np.full((8, 8), 32768, dtype=np.uint16)  # mid-grey in 16 bits
    data = encode(Image.fromarray(a))
    out = np.asarray(decode_image(data, "g16.png", 3, LIMIT))
    assert 120 <= out.mean() <= 135


def test_cmyk_jpeg() -> None:
    data = encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG")  # red in CMYK
    r, g, b = np.asarray(decode_image(data, "c.jpg", 3, LIMIT)).reshape(-1, 3).mean(0)
    assert r > 200 and g < 60 and b < 60


def test_palette_with_transparency_is_composited_over_white() -> None:
    p = Image.new("P", (8, 8), 0)
    p.putpalette([0, 0, 0] * 256)
    p.info["transparency"] = 0
    out = np.asarray(decode_image(encode(p), "t.png", 3, LIMIT))
    assert out.min() == 255  # fully transparent black becomes white


def test_animated_gif_uses_the_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ("red", "blue")]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    r, _, b = np.asarray(decode_image(buf.getvalue(), "a.gif", 3, LIMIT)).reshape(-1, 3).mean(0)
    assert r > 200 and b < 50


def test_one_pixel_image() -> None:
    assert decode_image(encode(Image.new("RGB", (1, 1))), "dot.png", 3, LIMIT).size == (1, 1)


def test_bomb_is_refused_from_the_header() -> None:
    with pytest.raises(PayloadTooLarge, match="100000x100000"):
        decode_image(png_with_header(100_000, 100_000), "bomb.png", 3, LIMIT)


@pytest.mark.parametrize(
    ("data", "error"),
    [(b"", InvalidInput), (b"\x00" * 50, UnsupportedMediaType), (png_with_header(10, 10), InvalidInput)],
)
def test_bad_bytes(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error, match="x.png"):
        decode_image(data, "x.png", 3, LIMIT)
