"""The limit without HTTP: raw forward throughput on pre-made tensors, and per-image preprocessing cost."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import torch
from PIL import Image

from app.core.backends.predictor import Backend, Predictor, batch_sizes
from app.core.images.decode import decode_image
from app.core.images.prepare import Preprocessor
from model.checkpoint import Checkpoint
from model.shapes import make_sample


@dataclass
class ForwardResult:
    batch_size: int
    images_per_s: float
    ms_per_batch: float


@torch.inference_mode()
def forward_throughput(
    ckpt: Checkpoint, device: torch.device, max_batch_size: int, backend: Backend, seconds: float = 1.5
) -> list[ForwardResult]:
    """Images per second of the backend's forward alone (what the service runs for plain probabilities)
    at batch sizes 1, 2, 4, ... up to the maximum."""
    predictor = Predictor(ckpt, device, backend)
    c = ckpt.config
    results = []
    for bs in batch_sizes(max_batch_size):
        x = torch.randn(bs, c.in_channels, c.image_size, c.image_size, device=device, dtype=predictor.dtype)
        for _ in range(2):
            predictor.forward_plain(x)
        n, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds or n < 2:
            predictor.forward_plain(x)
            n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        results.append(ForwardResult(bs, n * bs / elapsed, elapsed / n * 1e3))
    return results


# small: the bundled model's own 64 px image; medium: an ImageNet-sized photo
SAMPLE_SIZES: dict[str, tuple[int, int] | None] = {"small": None, "medium": (500, 375), "large": (1024, 768)}


def sample_images() -> dict[str, bytes]:
    """PNG and JPEG at each of SAMPLE_SIZES, named `png-small` to `jpeg-large`."""
    small = make_sample(4242, 0).image
    out = {}
    for name, size in SAMPLE_SIZES.items():
        image = small if size is None else small.resize(size, Image.Resampling.BICUBIC)
        for fmt in ("PNG", "JPEG"):
            buf = io.BytesIO()
            image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
            out[f"{fmt.lower()}-{name}"] = buf.getvalue()
    return out


def sample_label(name: str) -> str:
    """A sample image's name in prose: `jpeg-medium` -> `500x375 JPEG`."""
    kind, size = name.split("-")
    dims = SAMPLE_SIZES[size]
    return f"{'64 px' if dims is None else f'{dims[0]}x{dims[1]}'} {kind.upper()}"


def preprocessing_cost(ckpt: Checkpoint, repeats: int = 50) -> dict[str, float]:
    """Milliseconds to decode, validate and preprocess one upload, per sample image."""
    pre = Preprocessor(ckpt.preprocessing)
    costs = {}
    for name, data in sample_images().items():
        started = time.perf_counter()
        for _ in range(repeats):
            pre(decode_image(data, name, ckpt.config.in_channels, 100_000_000))
        costs[name] = (time.perf_counter() - started) / repeats * 1e3
    return costs
