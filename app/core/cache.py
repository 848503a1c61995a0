"""The response cache (VIT_CACHE_BYTES): each image's prediction, kept by what it was computed from.

An entry's key covers everything that changes the answer: the model's name and version (a reload never
serves the old version's answers), the SHA-256 of the image's bytes (or of one row of pixels with its
shape and dtype), and every option that changes an image's output (attention kind and resolved target,
embedding and normalize, overlay). The value is the core's `Prediction`, not an encoded response, so
`/predict`, V2 over REST and gRPC and the batch runner share it; a hit is answered under the request's
own file name and encoded as the request asks (top_k, outputs).

The cache is bounded by bytes (the tensors, the overlay PNG and a fixed overhead per entry) and evicts the
least recently used entries. Identical images that miss together are computed once: the first request
computes, the others wait for its answer (and compute it themselves if that request fails or leaves).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.core.metrics import Metrics
from app.core.request import DecodedImage, EncodedImage, InferOptions, Prediction

ENTRY_OVERHEAD_BYTES = 400  # the key, the Prediction object and its tensors' headers, the dict slot


def digest_images(images: Sequence[EncodedImage | DecodedImage]) -> list[bytes]:
    return [hashlib.sha256(image.data).digest() for image in images]


def digest_pixels(pixels: torch.Tensor) -> list[bytes]:
    rows = pixels.detach().cpu().contiguous()
    described = f"{list(rows.shape[1:])}|{rows.dtype}".encode()
    return [hashlib.sha256(described + row.numpy().tobytes()).digest() for row in rows]


def prediction_bytes(p: Prediction) -> int:
    tensors = (p.probabilities, p.attention_map, p.embedding)
    size = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return size + (len(p.overlay_png) if p.overlay_png is not None else 0) + ENTRY_OVERHEAD_BYTES


@dataclass
class Claim:
    """What the cache holds for one image of a request: its prediction (a hit), another request's
    computation to wait for, or nothing: then this request computes it and must `fulfil` or `abandon` it."""

    key: bytes
    hit: Prediction | None = None
    wait: asyncio.Future[Prediction] | None = None

    @property
    def mine(self) -> bool:
        return self.hit is None and self.wait is None


class Abandoned(Exception):
    """The request computing an entry failed or left: whoever waited computes it."""


class PredictionCache:
    """At most `max_bytes` of predictions, least recently used evicted; `metrics` counts hits and misses."""

    def __init__(self, max_bytes: int, metrics: Metrics) -> None:
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.entries: OrderedDict[bytes, tuple[Prediction, int]] = OrderedDict()
        self.size = 0
        self.computing: dict[bytes, asyncio.Future[Prediction]] = {}

    @staticmethod
    def key(model: str, version: str, options: InferOptions, target: int | None, digest: bytes) -> bytes:
        wanted = f"{model}\0{version}\0{options.attention}\0{target}\0{options.embedding}\0{options.normalize}"
        return hashlib.sha256(f"{wanted}\0{options.overlay}\0".encode() + digest).digest()

    def claim(self, model: str, keys: list[bytes]) -> list[Claim]:
        """Each key's claim, counted as a hit (held, or being computed) or a miss (this request computes it)."""
        claims = []
        hits = 0
        loop = asyncio.get_running_loop()
        for key in keys:
            if (entry := self.entries.get(key)) is not None:
                self.entries.move_to_end(key)
                claims.append(Claim(key, hit=entry[0]))
                hits += 1
            elif (future := self.computing.get(key)) is not None:
                claims.append(Claim(key, wait=future))
                hits += 1
            else:
                future = loop.create_future()
                future.add_done_callback(retrieved)
                self.computing[key] = future
                claims.append(Claim(key))
        if hits:
            self.metrics.cache_hits.labels(model).inc(hits)
        if len(keys) > hits:
            self.metrics.cache_misses.labels(model).inc(len(keys) - hits)
        return claims

    def fulfil(self, key: bytes, prediction: Prediction) -> None:
        """A computed prediction: kept (evicting the least recently used), and given to whoever waits."""
        future = self.computing.pop(key, None)
        if future is not None and not future.done():
            future.set_result(prediction)
        size = prediction_bytes(prediction)
        if size > self.max_bytes or key in self.entries:
            return
        self.entries[key] = (prediction, size)
        self.size += size
        while self.size > self.max_bytes:
            _, (_, evicted) = self.entries.popitem(last=False)
            self.size -= evicted
        self.metrics.cache_bytes.set(self.size)

    def abandon(self, key: bytes) -> None:
        future = self.computing.pop(key, None)
        if future is not None and not future.done():
            future.set_exception(Abandoned())


def retrieved(future: asyncio.Future[Prediction]) -> None:
    """An abandoned entry nobody waited for is not an error to log."""
    if not future.cancelled():
        future.exception()
