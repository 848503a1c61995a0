"""Generated images and image files, valid and hostile."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from model.shapes import SHAPE_CLASSES, make_sample


def encode(image: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def held_out(label: str) -> bytes:
    """A PNG of the first image of class `label` in the held-out `shapes` set (model.evaluate's default seed)."""
    from model.evaluate import DEFAULT_SHAPES_EVAL_SEED  # here: model.evaluate imports torch

    samples = (make_sample(DEFAULT_SHAPES_EVAL_SEED, i) for i in range(500))
    return encode(next(s for s in samples if SHAPE_CLASSES[s.label] == label).image)


def png_with_header(width: int, height: int) -> bytes:
    """A PNG signature and IHDR declaring width x height, with a tiny (bogus) IDAT: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")
    )


def photo_jpeg(seed: int) -> bytes:
    """A distinct 500x375 JPEG with gradients and noise, as a photo of that size costs to decode."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:375, 0:500]
    channels = [(xs * 0.8 + seed * 7) % 256, (ys * 1.2 + seed * 3) % 256, ((xs + ys) * 0.5) % 256]
    pixels = np.stack(channels, -1) + rng.normal(0, 12, (375, 500, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()
