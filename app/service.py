"""The loaded service: every served model, the shared decode pool, readiness and shutdown.

It is built whole by `Service.load` (models loaded and warm), then started on the event loop.
It knows nothing of HTTP: the routes read requests, watch for disconnects and map errors.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from app.errors import ModelNotFound
from app.inference import ImageOutput
from app.metrics import Metrics, ModelMetrics
from app.postprocess import to_result
from app.schemas import PredictResponse
from app.served_model import ServedModel
from app.settings import Settings
from app.uploads import Upload
from model.device import resolve_device

log = logging.getLogger("app")


@dataclass(frozen=True)
class PredictOptions:
    top_k: int = 5
    attention: str = "none"
    overlay: bool = False
    target: int | None = None  # the class a gradient map explains (None: each image's top-1)


class Service:
    def __init__(self, settings: Settings, metrics: Metrics, models: dict[str, ServedModel]) -> None:
        if not models:
            raise ValueError("a service needs at least one model")
        self.settings = settings
        self.metrics = metrics
        self.models = models
        self.default = next(iter(models.values()))  # the first one named in VIT_MODELS
        self.api_keys = settings.api_key_set()
        self.ready = False
        self.decode_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="decode")

    @classmethod
    def load(cls, settings: Settings, metrics: Metrics) -> Service:
        """Load and warm up every model (blocking; run off the event loop)."""
        if settings.threads:
            torch.set_num_threads(settings.threads)
        try:
            device = resolve_device(settings.device)
        except ValueError as e:
            raise ValueError(f"VIT_DEVICE: {e}") from None
        models = {
            name: ServedModel.load(name, path, settings, device, ModelMetrics(metrics, name))
            for name, path in settings.model_paths().items()
        }
        return cls(settings, metrics, models)

    def start(self) -> None:
        """Start every model's batcher; ready once all are loaded, warm and running."""
        for model in self.models.values():
            model.batcher.start()
        self.ready = True
        self.metrics.ready.set(1)

    def model(self, name: str | None) -> ServedModel:
        """The model called `name`, or the default one."""
        if name is None:
            return self.default
        found = self.models.get(name)
        if found is None:
            raise ModelNotFound(f"no model named {name!r}; this service serves: {', '.join(self.models)}")
        return found

    async def predict(self, model: ServedModel, uploads: list[Upload], options: PredictOptions) -> PredictResponse:
        """One /predict request: images in, top-k, probabilities and maps out."""
        prepared, outputs = await model.run_uploads(
            uploads, options.attention, options.overlay, self.decode_pool, self.settings.request_timeout_s,
            options.target,
        )  # fmt: skip
        results = [
            to_result(p.filename, out, model.classes, options.top_k, options.attention, p.image)
            for p, out in zip(prepared, outputs, strict=True)
        ]
        return PredictResponse(model=model.ref, results=results)

    async def compute(
        self, model: ServedModel, uploads: list[Upload] | None, pixels: torch.Tensor | None, attention: str,
        target: int | None = None,
    ) -> list[ImageOutput]:  # fmt: skip
        """Outputs for encoded files (decoded as /predict decodes them) or for preprocessed pixels."""
        timeout = self.settings.request_timeout_s
        if uploads is not None:
            _, outputs = await model.run_uploads(uploads, attention, False, self.decode_pool, timeout, target)
            return outputs
        assert pixels is not None
        return await model.run_pixels(pixels, attention, timeout, target)

    async def shutdown(self) -> None:
        """Turn unready, answer every accepted image of every model, then stop."""
        self.ready = False
        self.metrics.ready.set(0)
        timeout = self.settings.drain_timeout_s
        drained = await asyncio.gather(*(m.batcher.drain(timeout) for m in self.models.values()))
        for model, ok in zip(self.models.values(), drained, strict=True):
            if not ok:
                log.warning("model %s: drain timed out after %.1fs with %d images queued",
                            model.name, timeout, model.batcher.queue_depth)  # fmt: skip
            await model.batcher.stop()
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
