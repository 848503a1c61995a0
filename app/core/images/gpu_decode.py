"""JPEG decoding and preprocessing on the GPU, a batch at a time (nvJPEG, through torchvision).

On a GPU host, decoding and resizing uploads on the CPU is what bounds the service: a 500x375
JPEG costs a core about 3 ms to decode, resize and normalise. Plain JPEGs (baseline, RGB or
grayscale, upright, whole) are instead checked from their header on the CPU pool and decoded on
the forward thread with the batch they ride in: one nvJPEG call for the batch, then the checkpoint's
own tensor transform (antialiased resize, crop, scale, normalise) on the device, images of one size
resized together. Every other image (PNG, progressive, CMYK, rotated by EXIF, overlays) is decoded
on the CPU as before, and a JPEG that nvJPEG rejects is decoded again by PIL, whose verdict
(pixels, or a 4xx for a broken file) is final.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor

from model.preprocessing import Preprocessing, luminance, normalize, resize_and_crop, to_float

EXIF_ORIENTATION = 0x0112
JPEG_END = b"\xff\xd9"


@dataclass(frozen=True)
class Jpeg:
    """A JPEG file whose header passed the checks, to be decoded on the GPU with its batch."""

    data: bytes
    filename: str


def gpu_decodable(header: Image.Image, data: bytes) -> bool:
    """A JPEG nvJPEG decodes as PIL would: baseline, RGB or grayscale, no EXIF rotation, not cut short."""
    if header.format != "JPEG" or header.mode not in ("RGB", "L") or header.info.get("progressive"):
        return False
    if not data.rstrip(b"\x00").endswith(JPEG_END):  # a truncated file goes to PIL, which says so
        return False
    return header.getexif().get(EXIF_ORIENTATION, 1) == 1


def blank_jpeg(shape: tuple[int, int, int]) -> bytes:
    """A grey JPEG of the given (channels, height, width): what the warm-up decodes."""
    channels, height, width = shape
    buffer = io.BytesIO()
    Image.new("RGB" if channels == 3 else "L", (width, height), 128).save(buffer, format="JPEG")
    return buffer.getvalue()


class GpuJpegDecoder:
    """`Jpeg` files -> normalised (N, C, S, S) float32 on the device, as `EvalTransform` makes them on the CPU.

    The resize is the tensor transform's antialiased one (what `resize_backend="tensor"` checkpoints use on
    the CPU too); for `resize_backend="pil"` checkpoints it differs from PIL's by rounding. `fallback` decodes
    a file nvJPEG rejects on the CPU: it returns the file's (C, S, S) pixels or raises the client's error.
    """

    def __init__(self, p: Preprocessing, device: torch.device, fallback: Callable[[Jpeg], Tensor]) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg  # here: only a GPU host decodes with nvJPEG

        self.decode_jpeg = functools.partial(decode_jpeg, mode=ImageReadMode.RGB, device=device)
        self.preprocessing = p
        self.device = device
        self.fallback = fallback

    def __call__(self, files: Sequence[Jpeg]) -> Tensor:
        p = self.preprocessing
        decoded = self.decode([f.data for f in files])
        out = torch.empty(len(files), p.channels, p.image_size, p.image_size, device=self.device)
        by_size: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, image in enumerate(decoded):
            if image is None:
                out[i] = self.fallback(files[i]).to(self.device, non_blocking=True)
            else:
                by_size[tuple(image.shape)].append(i)
        for rows in by_size.values():  # images of one size are resized together
            out[rows] = self.transform(torch.stack([decoded[i] for i in rows]))  # type: ignore[misc]
        return out

    def decode(self, files: Sequence[bytes]) -> list[Tensor | None]:
        """(3, H, W) uint8 RGB on the device per file (grayscale files too); None for a file nvJPEG could not decode."""
        data = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
        with warnings.catch_warnings():
            # torchvision 0.29 announces that its image codecs will move to TorchCodec; they still work
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision")
            try:
                return list(self.decode_jpeg(data))
            except Exception:  # one bad file fails the batched call: decode each alone to find it
                return [self.decode_one(d) for d in data]

    def decode_one(self, data: Tensor) -> Tensor | None:
        try:
            return self.decode_jpeg(data)
        except Exception:  # nvJPEG's verdict on this file; PIL's decides
            return None

    def transform(self, images: Tensor) -> Tensor:
        """(n, 3, H, W) uint8 RGB -> (n, C, S, S) float32: channels, resize and crop, scale to [0, 1], normalise."""
        p = self.preprocessing
        if p.channels == 1:  # luminance rounded to uint8, as PIL's RGB -> L
            images = luminance(images.float()).round_().to(torch.uint8)
        return normalize(to_float(resize_and_crop(images, p)), p.mean, p.std)
