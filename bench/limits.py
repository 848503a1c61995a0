"""The limit without HTTP: raw forward throughput on pre-made tensors, and per-image preprocessing cost."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from app.core.backends.predictor import Backend, Predictor, batch_sizes
from app.core.images.decode import decode_image
from app.core.images.prepare import Preprocessor
from bench.common import sample_images
from model.checkpoint import Checkpoint


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
