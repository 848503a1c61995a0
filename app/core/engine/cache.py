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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from app.core.contract.errors import TIMED_OUT, RequestTimeout
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions, Prediction
from app.telemetry.metrics import Metrics

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


@dataclass(frozen=True)
class Found:
    """A request's predictions through the cache, in key order, and how they were come by."""

    predictions: list[Prediction]
    hits: int  # held, or computed by another request under way
    misses: int  # computed by this request
    recomputed: int  # hits whose computation was abandoned, computed by this request after all

    @property
    def computed(self) -> bool:
        return self.misses + self.recomputed > 0


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
    def keys(model: str, version: str, options: InferOptions, target: int | None, digests: list[bytes]) -> list[bytes]:
        """Each image's key: the model version (with a head's digest, for a request to a head), all that was asked
        that changes an answer, and the image's digest."""
        o = options
        labels = None if o.labels is None else "\x1f".join(o.labels)
        asked: tuple[object, ...] = (model, version, o.attention, target, o.embedding, o.normalize, o.overlay)
        asked += (o.ood, labels, o.template, o.classify, o.head)
        wanted = hashlib.sha256("\0".join(map(repr, asked)).encode()).digest()  # once per request: labels may be many
        return [hashlib.sha256(wanted + digest).digest() for digest in digests]

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

    async def through(
        self,
        model: str,
        keys: list[bytes],
        compute: Callable[[list[int]], Awaitable[list[Prediction]]],
        wait_s: float,
    ) -> Found:
        """Each key's prediction: held, awaited from the request computing it (within `wait_s`), or computed
        with `compute(indices)` and kept. Whatever this request claimed and could not compute is abandoned, so
        the requests waiting for it compute it themselves; an error of `compute` is this request's."""
        claims = self.claim(model, keys)
        mine = [i for i, c in enumerate(claims) if c.mine]
        found: dict[int, Prediction] = {i: c.hit for i, c in enumerate(claims) if c.hit is not None}
        if mine:
            try:
                computed = await compute(mine)
            except BaseException:
                for i in mine:
                    self.abandon(keys[i])
                raise
            for i, p in zip(mine, computed, strict=True):
                self.fulfil(keys[i], p)
                found[i] = p
        waits = {i: c.wait for i, c in enumerate(claims) if c.wait is not None}
        again: list[int] = []  # waited for, then computed here: their computation was abandoned
        if waits:  # computed by other requests under way
            try:
                results = await asyncio.wait_for(
                    asyncio.gather(*(asyncio.shield(f) for f in waits.values()), return_exceptions=True), wait_s
                )
            except TimeoutError:
                raise RequestTimeout(TIMED_OUT) from None
            answered = dict(zip(waits, results, strict=True))
            found |= {i: r for i, r in answered.items() if isinstance(r, Prediction)}
            again = [i for i, r in answered.items() if not isinstance(r, Prediction)]
            if again:  # the request computing them failed or left (its error, if any, is this one's too)
                found |= dict(zip(again, await compute(again), strict=True))
        predictions = [found[i] for i in range(len(keys))]
        return Found(predictions, hits=len(keys) - len(mine), misses=len(mine), recomputed=len(again))

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
