from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from app.core.contract.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from app.core.images.decode import decode_image
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


def noisy_jpeg(width: int, height: int, **kw: object) -> bytes:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "JPEG", **kw)


@pytest.mark.parametrize(
    ("size", "draft_to", "decoded"),
    [
        ((2048, 1536), 256, (512, 384)),  # 1/4: 1/8 would make the shorter side 192
        ((4032, 3024), 248, (504, 378)),  # a phone photo for ViT-S/16's 248: 1/8
        ((600, 400), 200, (300, 200)),  # exactly twice: 1/2
        ((500, 375), 256, (500, 375)),  # under twice the size: decoded in full
    ],
)
def test_a_large_jpeg_is_scaled_while_decoding_and_stays_at_least_the_resize_size(
    size: tuple[int, int], draft_to: int, decoded: tuple[int, int]
) -> None:
    out = decode_image(noisy_jpeg(*size), "p.jpg", 3, 40_000_000, draft_to)
    assert out.size == decoded and out.mode == "RGB"
    assert min(out.size) >= draft_to
    assert decode_image(noisy_jpeg(*size), "p.jpg", 3, 40_000_000).size == size  # without it: in full


def test_only_jpegs_are_scaled_while_decoding() -> None:
    png = encode(Image.new("RGB", (1024, 768), "green"))
    assert decode_image(png, "p.png", 3, LIMIT, draft_to=128).size == (1024, 768)


def test_a_scaled_jpeg_is_still_turned_upright_and_made_grayscale() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    out = decode_image(noisy_jpeg(1600, 800, exif=exif.tobytes()), "r.jpg", 1, LIMIT, draft_to=200)
    assert out.size == (200, 400) and out.mode == "L"  # 1/4 of 1600x800, then turned
