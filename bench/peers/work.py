"""What every peer server runs, so that each does the service's work and nothing else: the checkpoint loaded by
`model.checkpoint`, an upload decoded by the service's own decoder (a large JPEG drafted to the resize size, as the
service does by default) and preprocessed by the checkpoint's evaluation transform, a batch's forward on the torch
threads given, and softmax probabilities back.

Each batch a peer runs is counted (`VIT_PEER_STATS`, a folder: one small file per process, its images and batches
so far), so that the benchmark reads the batches the peer really formed rather than the ones it was asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from app.core.images.decode import decode_image
from app.core.images.prepare import Preprocessor
from model.checkpoint import load_checkpoint

MAX_PIXELS = 40_000_000


class Work:
    def __init__(self, weights: str | Path, threads: int) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.checkpoint = load_checkpoint(Path(weights), torch.device("cpu"))
        self.model = self.checkpoint.model.float().eval()
        self.classes = self.checkpoint.classes
        self.preprocess = Preprocessor(self.checkpoint.preprocessing)
        self.channels = self.checkpoint.config.in_channels
        self.draft_to = self.checkpoint.preprocessing.resize_size
        self.count = BatchCounter()

    def decode(self, data: bytes) -> Tensor:
        """An upload's bytes -> the (C, S, S) float32 tensor the service would make of it."""
        return self.preprocess(decode_image(data, "upload", self.channels, MAX_PIXELS, self.draft_to))

    @torch.inference_mode()
    def forward(self, batch: Tensor) -> Tensor:
        """(N, C, S, S) -> (N, classes) probabilities, float32."""
        probs = self.model(batch).float().softmax(-1)
        self.count(len(batch))
        return probs

    def __call__(self, uploads: list[bytes]) -> list[list[float]]:
        """A batch of uploads -> each one's probabilities."""
        probs: list[list[float]] = self.forward(torch.stack([self.decode(u) for u in uploads])).tolist()
        return probs


class BatchCounter:
    """Counts the batches this process runs into `VIT_PEER_STATS/<pid>` (nothing where that is not set)."""

    def __init__(self) -> None:
        stats = os.environ.get("VIT_PEER_STATS")
        self.fd = os.open(Path(stats) / str(os.getpid()), os.O_WRONLY | os.O_CREAT, 0o644) if stats else None
        self.images = self.batches = 0

    def __call__(self, images: int) -> None:
        self.images += images
        self.batches += 1
        if self.fd is not None:  # one write of fixed width, in place: never read half-written
            os.pwrite(self.fd, f"{self.images:>15} {self.batches:>15}\n".encode(), 0)


def batch_counts(folder: Path) -> tuple[int, int]:
    """(images, batches) every process of a peer has run so far."""
    images = batches = 0
    for f in folder.iterdir():
        try:
            i, b = f.read_text().split()
        except (OSError, ValueError):  # being written
            continue
        images, batches = images + int(i), batches + int(b)
    return images, batches
