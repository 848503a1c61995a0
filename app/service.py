"""The loaded service: checkpoint, predictor and batcher, and the path of one /predict request.

decode (thread pool) -> preprocess -> DynamicBatcher -> Predictor (forward thread) -> postprocess
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch
from fastapi import Request
from PIL import Image

from app.batcher import DynamicBatcher
from app.decode import decode_image
from app.errors import RequestTimeout
from app.inference import ImageInput, ImageOutput, Predictor
from app.metrics import Metrics
from app.postprocess import to_result
from app.preprocess import Preprocessor
from app.schemas import ModelInfo, ModelRef, PredictResponse
from app.settings import Settings
from app.uploads import Upload
from model.checkpoint import Checkpoint, load_checkpoint
from model.device import resolve_device

log = logging.getLogger("app")


@dataclass(frozen=True)
class PredictOptions:
    top_k: int = 5
    attention: str = "none"
    overlay: bool = False


@dataclass(frozen=True)
class Prepared:
    filename: str
    image: Image.Image | None  # kept only when an overlay is drawn
    pixels: torch.Tensor


class ClientDisconnected(Exception):
    """The client went away while its request waited; nothing is sent back."""


class Service:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.api_keys = settings.api_key_set()
        self.ready = False
        self.checkpoint: Checkpoint | None = None
        self.predictor: Predictor | None = None
        self.batcher: DynamicBatcher[ImageInput, ImageOutput] | None = None
        self.preprocessor: Preprocessor | None = None
        self.decode_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="decode")

    def load(self) -> None:
        """Load the checkpoint onto the device and warm it up (blocking; run off the event loop)."""
        s = self.settings
        if s.threads:
            torch.set_num_threads(s.threads)
        try:
            device = resolve_device(s.device)
        except ValueError as e:
            raise ValueError(f"VIT_DEVICE: {e}") from None
        self.checkpoint = load_checkpoint(s.weights, device)
        self.predictor = Predictor(self.checkpoint, device)
        self.preprocessor = Preprocessor(self.checkpoint.preprocessing)
        log.info(
            "loaded %s (version %s, %d classes) on %s as %s",
            s.weights, self.checkpoint.version, len(self.checkpoint.classes), device, self.predictor.dtype,
        )  # fmt: skip
        if s.warmup:
            self.predictor.warm_up(s.max_batch_size)

    def start(self) -> None:
        assert self.predictor is not None
        s = self.settings
        self.batcher = DynamicBatcher(self.predictor, s.max_batch_size, s.max_wait_ms, s.max_queue, self.metrics)
        self.batcher.start()
        self.ready = True
        self.metrics.ready.set(1)

    async def shutdown(self) -> None:
        """Turn unready, answer every accepted image, then stop."""
        self.ready = False
        self.metrics.ready.set(0)
        if self.batcher is not None:
            if not await self.batcher.drain(self.settings.drain_timeout_s):
                log.warning(
                    "drain timed out after %.1fs with %d images queued",
                    self.settings.drain_timeout_s,
                    self.batcher.queue_depth,
                )
            await self.batcher.stop()
        self.decode_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def model_ref(self) -> ModelRef:
        assert self.checkpoint is not None
        return ModelRef(name=self.settings.weights.stem, version=self.checkpoint.version)

    def model_info(self) -> ModelInfo:
        assert self.checkpoint is not None and self.predictor is not None
        c = self.checkpoint
        return ModelInfo(
            name=self.model_ref.name,
            version=c.version,
            content_hash=c.content_hash,
            classes=c.classes,
            input_size=[c.config.image_size, c.config.image_size],
            channels=c.config.in_channels,
            config=c.config.to_dict(),
            preprocessing=asdict(c.preprocessing),
            training=c.training,
            device=str(self.predictor.device),
            dtype=str(self.predictor.dtype).removeprefix("torch."),
        )

    def prepare(self, upload: Upload, keep_image: bool) -> Prepared:
        """Decode, validate and preprocess one upload (runs on the decode pool)."""
        assert self.checkpoint is not None and self.preprocessor is not None
        image = decode_image(
            upload.data, upload.filename, self.checkpoint.config.in_channels, self.settings.max_image_pixels
        )
        return Prepared(upload.filename, image if keep_image else None, self.preprocessor(image))

    async def predict(self, uploads: list[Upload], options: PredictOptions, request: Request) -> PredictResponse:
        """One request: all its images are decoded first, so a bad one fails the request before any compute."""
        assert self.batcher is not None and self.checkpoint is not None
        deadline = time.monotonic() + self.settings.request_timeout_s
        loop = asyncio.get_running_loop()
        with self.batcher.admit(len(uploads)) as admission:  # refused here, before any CPU is spent on decoding
            prepared = await asyncio.gather(
                *(loop.run_in_executor(self.decode_pool, self.prepare, u, options.overlay) for u in uploads)
            )
            futures = admission.submit([ImageInput(p.pixels, options.attention) for p in prepared], deadline)
        outputs = await wait_for_outputs(futures, request, deadline)
        classes = self.checkpoint.classes
        results = [
            to_result(p.filename, out, classes, options.top_k, options.attention, p.image)
            for p, out in zip(prepared, outputs, strict=True)
        ]
        return PredictResponse(model=self.model_ref, results=results)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_for_outputs(
    futures: list[asyncio.Future[ImageOutput]], request: Request, deadline: float
) -> list[ImageOutput]:
    """All outputs of one request; cancels its queued images if the client leaves or time runs out."""
    gathered: asyncio.Future[list[ImageOutput]] = asyncio.gather(*futures)
    watcher: asyncio.Future[None] = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        waiting: set[asyncio.Future[Any]] = {gathered, watcher}
        done, _ = await asyncio.wait(
            waiting, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
        )
        if gathered in done:
            if gathered.exception() is not None:  # one image failed: its siblings need not be computed
                for f in futures:
                    f.cancel()
            return list(gathered.result())
        gathered.cancel()  # the batcher skips cancelled images: they are never computed
        if watcher in done:
            raise ClientDisconnected()
        raise RequestTimeout("the request was not answered within VIT_REQUEST_TIMEOUT_S; retry or send fewer images")
    finally:
        watcher.cancel()
