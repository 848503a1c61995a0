"""The serving core's one entry: every served model, the CPU pool, readiness and shutdown.

`Service.load` builds it whole (models loaded and warm); `start` runs it on the event loop. Every
edge (`/predict`, V2 over REST and gRPC, the batch runner) calls `infer` with encoded images or
pixels and the options, and encodes the predictions in its own protocol. Models change at runtime
through `model_set` (a `ModelSet`). It knows nothing of HTTP or any other protocol.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from app.core.api_keys import ApiKeys
from app.core.errors import InvalidInput, ModelNotFound, NotReady
from app.core.inference import ImageOutput
from app.core.metrics import Metrics, ModelMetrics
from app.core.model_set import ModelSet
from app.core.overlay import overlay_png
from app.core.repository import FileStamp, Repository
from app.core.request import EncodedImage, InferOptions, Prediction
from app.core.served_model import Prepared, ServedModel, Wanted
from app.settings import Settings
from model.device import cuda_unavailable_reason, resolve_device

log = logging.getLogger("app")
T = TypeVar("T")


@dataclass(frozen=True)
class Inference:
    """One request's answer: the model version that computed it, and a prediction per image in input order."""

    model: ServedModel
    predictions: list[Prediction]


class Service:
    def __init__(self, settings: Settings, metrics: Metrics, models: ModelSet) -> None:
        self.settings = settings
        self.metrics = metrics
        self.model_set = models
        self.api_keys = ApiKeys(settings.api_key_set())
        self.ready = False
        # decoding, overlays and large responses: CPU work kept off the event loop
        self.cpu_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="cpu")

    @classmethod
    def load(cls, settings: Settings, metrics: Metrics) -> Service:
        """Load and warm up every model (blocking; run off the event loop)."""
        if settings.threads:
            torch.set_num_threads(settings.threads)
        try:
            device = resolve_device(settings.device)
        except ValueError as e:
            raise ValueError(f"VIT_DEVICE: {e}") from None
        if settings.device == "auto" and device.type == "cpu" and (reason := cuda_unavailable_reason()):
            log.warning("serving on the CPU: %s", reason)

        def build(name: str, path: Path) -> ServedModel:
            return ServedModel.load(name, path, settings, device, ModelMetrics(metrics, name))

        repository = Repository(settings.model_repository) if settings.model_repository else None
        files = repository.scan() if repository else {}
        served = {}
        for name, path in startup_models(settings, repository, files).items():
            started = time.perf_counter()
            served[name] = build(name, path)
            metrics.model_load_seconds.observe(time.perf_counter() - started)
        s = settings
        return cls(s, metrics, ModelSet(served, build, repository, s.model_control, metrics, s.drain_timeout_s, files))

    @property
    def models(self) -> dict[str, ServedModel]:
        """The models serving now, by name; the default first."""
        return self.model_set.served

    @property
    def default(self) -> ServedModel | None:
        """The model requests without a name go to: the first one loaded (VIT_MODELS' first)."""
        return next(iter(self.models.values()), None)

    def start(self) -> None:
        """Start every model's batcher; ready once all are loaded, warm and running."""
        # Everything alive now (torch, the models) lives until shutdown. Frozen, it is no longer
        # walked by each full collection: under load those stopped every thread for ~200 ms and
        # made the p99 (see vit_gc_pause_seconds).
        gc.collect()
        gc.freeze()
        self.metrics.watch_gc()
        for model in self.models.values():
            model.batcher.start()
        self.model_set.start_polling(self.settings.repository_poll_s)
        self.ready = True
        self.metrics.ready.set(1)

    def check_ready(self) -> None:
        if not self.ready:
            raise NotReady(NOT_READY)

    def model(self, name: str | None, version: str | None = None) -> ServedModel:
        """The model called `name` (the default one for None), at `version` when one is given."""
        model = self.default if name is None else self.models.get(name)
        if model is None:
            asked = "no model is loaded" if name is None else f"no model named {name!r}"
            raise ModelNotFound(f"{asked}; this service serves: {self.model_set.names()}")
        if version is not None and version != model.version:
            raise ModelNotFound(f"model {name!r} has no version {version!r}; it serves version {model.version}")
        return model

    async def infer(
        self,
        model: ServedModel,
        inputs: Sequence[EncodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None = None,
    ) -> Inference:
        """Predictions for encoded image files, or for preprocessed pixels (N, C, H, W), in input order.

        A model replaced since the edge looked it up answers with its new version; one unloaded since, not at
        all. `timeout_s` shortens VIT_REQUEST_TIMEOUT_S (a gRPC client's deadline).
        """
        model = self.model_set.current(model)  # no await from here until the batcher has admitted the request
        wanted = Wanted(options.attention, model.target_index(options.target), options.embedding)
        timeout = (
            self.settings.request_timeout_s if timeout_s is None else min(timeout_s, self.settings.request_timeout_s)
        )
        deadline = time.monotonic() + timeout
        if isinstance(inputs, torch.Tensor):
            if options.overlay:
                raise InvalidInput("an overlay is drawn over the image file: send images, not pixels")
            if tuple(inputs.shape[1:]) != model.input_shape:  # checked by the edge against a replaced version
                raise InvalidInput(
                    f"model {model.name} (version {model.version}) takes pixels of shape "
                    f"[-1, {', '.join(map(str, model.input_shape))}], got {list(inputs.shape)}"
                )
            outputs = await model.run_pixels(inputs, wanted, deadline)
            names = [f"pixels[{i}]" for i in range(len(outputs))]
            return Inference(
                model, [prediction(name, o, None, options.normalize) for name, o in zip(names, outputs, strict=True)]
            )
        prepared, outputs = await model.run_images(inputs, wanted, options.overlay, self.cpu_pool, deadline)
        if options.overlay:  # PNG encoding of every map: milliseconds each, on the pool
            return Inference(model, await self.run_in_pool(with_overlays, prepared, outputs, options.normalize))
        predictions = [
            prediction(p.filename, o, None, options.normalize) for p, o in zip(prepared, outputs, strict=True)
        ]
        return Inference(model, predictions)

    async def run_in_pool(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the CPU pool, so the event loop only parses, awaits and writes."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)

    async def encode(self, predictions: list[Prediction], fn: Callable[..., T], *args: object) -> T:
        """An edge's response encoder `fn(*args)` for these predictions: on the event loop when it costs
        less than the hop to the pool (a few numbers), on the pool for overlays, maps and many classes."""
        values = sum(p.probabilities.numel() + (0 if p.embedding is None else p.embedding.numel()) for p in predictions)
        costly = values > INLINE_ENCODE_MAX_VALUES or any(p.attention_map is not None for p in predictions)
        return await self.run_in_pool(fn, *args) if costly else fn(*args)

    async def shutdown(self) -> None:
        """Turn unready, answer every accepted image of every model, then stop."""
        self.ready = False
        self.metrics.ready.set(0)
        await self.model_set.close()  # a change under way finishes first
        timeout = self.settings.drain_timeout_s
        drained = await asyncio.gather(*(m.batcher.drain(timeout) for m in self.models.values()))
        for model, ok in zip(self.models.values(), drained, strict=True):
            if not ok:
                log.warning("model %s: drain timed out after %.1fs with %d images queued",
                            model.name, timeout, model.batcher.queue_depth)  # fmt: skip
            await model.batcher.stop()
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)
        self.metrics.unwatch_gc()
        gc.unfreeze()  # in-process apps (tests) give their objects back to the collector


# Encoding a response costs ~40 us per 1,000 probabilities (pydantic's serializer); a hop to the pool about as much.
INLINE_ENCODE_MAX_VALUES = 1000
NOT_READY = "not ready: the models are not loaded yet or the service is draining; retry shortly"


def startup_models(settings: Settings, repository: Repository | None, files: dict[str, FileStamp]) -> dict[str, Path]:
    """The checkpoints loaded before the service is ready, by model name, the default first.

    Without a repository: VIT_MODELS (or VIT_WEIGHTS). With one: VIT_MODELS' names, then, unless the
    control mode is explicit, every other model file in it.
    """
    if repository is None:
        return settings.model_paths()
    named = settings.model_names()
    if missing := [n for n in named if n not in files]:
        raise ValueError(
            f"VIT_MODELS names {', '.join(missing)}, but VIT_MODEL_REPOSITORY {repository.root} has no such "
            f"model file (NAME.safetensors); it has: {', '.join(files) or 'none'}"
        )
    names = named if settings.model_control == "explicit" else named + [n for n in files if n not in named]
    if not names and settings.model_control == "none":
        raise ValueError(f"VIT_MODEL_REPOSITORY {repository.root} holds no model file (NAME.safetensors) to serve")
    return {name: repository.path(name) for name in names}


def prediction(filename: str, output: ImageOutput, overlay: bytes | None, normalize: bool) -> Prediction:
    embedding = output.embedding
    if embedding is not None and normalize:
        embedding = torch.nn.functional.normalize(embedding, dim=0)
    return Prediction(filename, output.probabilities, output.attention_map, overlay, embedding)


def with_overlays(prepared: list[Prepared], outputs: list[ImageOutput], normalize: bool) -> list[Prediction]:
    """Predictions with each image's map drawn over it."""
    return [
        prediction(
            p.filename,
            o,
            overlay_png(p.image, o.attention_map) if p.image is not None and o.attention_map is not None else None,
            normalize,
        )
        for p, o in zip(prepared, outputs, strict=True)
    ]
