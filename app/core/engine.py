"""The engine: the in-process data plane, owning every served model, the CPU pool, readiness and shutdown.

`Engine.load` builds it whole (models loaded and warm); `start` runs it on the event loop, `shutdown`
answers what it admitted and stops; `Engine.serving` does all three around a block. Edges reach it only
through the `DataPlane` members; the rest (`model`, `served`, `model_set`) is the core's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import torch
from opentelemetry.util.types import AttributeValue

from app.core.api_keys import ApiKeys
from app.core.cache import PredictionCache, digest_images, digest_pixels
from app.core.data_plane import Inference, InferenceRequest, Limits, costly_to_encode
from app.core.description import ModelDescription, ModelStatus
from app.core.errors import NOT_READY, TIMED_OUT, InvalidInput, ModelNotFound, NotReady, RequestTimeout
from app.core.inference import ImageOutput
from app.core.metrics import Metrics, ModelMetrics
from app.core.model_set import ModelSet
from app.core.overlay import overlay_png
from app.core.prepare import Prepared
from app.core.repository import FileStamp, Repository
from app.core.request import DecodedImage, EncodedImage, InferOptions, Prediction
from app.core.served_model import ServedModel, Wanted
from app.core.statistics import ModelStatistics, RequestTiming, StatisticsBook
from app.core.tracing import child_span, record_span
from app.settings import Settings
from model.device import cuda_unavailable_reason, resolve_device

log = logging.getLogger("app")
T = TypeVar("T")


class Engine:
    """A `DataPlane` in this process."""

    def __init__(
        self, settings: Settings, metrics: Metrics, models: ModelSet, statistics: StatisticsBook | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.book = statistics or StatisticsBook()
        self.model_set = models
        self.limits = Limits(settings.max_upload_bytes, settings.max_files)
        self.api_keys = ApiKeys(settings.api_key_set())
        self.cache = PredictionCache(settings.cache_bytes, metrics) if settings.cache_bytes else None
        self.is_ready = False  # what readiness probes are told
        self.taking_requests = False  # whether requests are taken (also while draining)
        self.started = False
        self.froze_heap = False  # by `start`, for its owner
        # decoding, overlays and large responses: CPU work kept off the event loop
        self.cpu_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="cpu")

    @classmethod
    def load(cls, settings: Settings, metrics: Metrics | None = None) -> Engine:
        """Load and warm up every model (blocking; run off the event loop)."""
        metrics = metrics or Metrics()
        statistics = StatisticsBook()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        try:
            device = resolve_device(settings.device)
        except ValueError as e:
            raise ValueError(f"VIT_DEVICE: {e}") from None
        if settings.device == "auto" and device.type == "cpu" and (reason := cuda_unavailable_reason()):
            log.warning("serving on the CPU: %s", reason)

        def build(name: str, path: Path) -> ServedModel:
            return ServedModel.load(name, path, settings, device, ModelMetrics(metrics, name, statistics))

        repository = Repository(settings.model_repository) if settings.model_repository else None
        files = repository.scan() if repository else {}
        served = {}
        for name, path in startup_models(settings, repository, files).items():
            started = time.perf_counter()
            served[name] = build(name, path)
            metrics.model_load_seconds.observe(time.perf_counter() - started)
        s = settings
        models = ModelSet(served, build, repository, s.model_control, metrics, s.drain_timeout_s, files)
        return cls(s, metrics, models, statistics)

    @classmethod
    @asynccontextmanager
    async def serving(
        cls, settings: Settings, metrics: Metrics | None = None, freeze_heap: bool = False
    ) -> AsyncIterator[Engine]:
        """Loaded (on a thread), started on this event loop (see `start` for `freeze_heap`), and shut down
        after the block."""
        engine = await asyncio.to_thread(cls.load, settings, metrics)
        engine.start(freeze_heap)
        try:
            yield engine
        finally:
            await engine.shutdown()

    # The core's own view: served models as objects.
    @property
    def served(self) -> dict[str, ServedModel]:
        """The models serving now, by name; the default first."""
        return self.model_set.served

    @property
    def default(self) -> ServedModel | None:
        """The model requests without a name go to: the first one loaded (VIT_MODELS' first)."""
        return next(iter(self.served.values()), None)

    def model(self, name: str | None, version: str | None = None) -> ServedModel:
        """The model called `name` (the default one for None), at `version` when one is given."""
        model = self.default if name is None else self.served.get(name)
        if model is None:
            asked = "no model is loaded" if name is None else f"no model named {name!r}"
            raise ModelNotFound(f"{asked}; this service serves: {self.model_set.names()}")
        if version is not None and version != model.version:
            raise ModelNotFound(f"model {name!r} has no version {version!r}; it serves version {model.version}")
        return model

    def start(self, freeze_heap: bool = False) -> None:
        """Start every model's batcher; ready once all are loaded, warm and running.

        With `freeze_heap`, asked by the process's owner (`python -m app`, the engine process, the batch
        runner), everything alive now (torch, the models) is collected once and frozen until shutdown: no
        longer walked by each full collection, which under load stopped every thread for ~200 ms and made
        the p99 (see vit_gc_pause_seconds). An engine inside another program (an in-process app, a test)
        leaves that program's collector alone."""
        if freeze_heap:
            gc.collect()
            gc.freeze()
        self.froze_heap = freeze_heap
        self.metrics.watch_gc()
        for model in self.served.values():
            model.batcher.start()
        self.model_set.start_polling(self.settings.repository_poll_s)
        self.started = True
        self.taking_requests = True
        self.is_ready = True
        self.metrics.ready.set(1)

    # The DataPlane.
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.is_ready

    def check_serving(self) -> None:
        if not self.taking_requests:
            raise NotReady(NOT_READY)

    def authorize(self, credentials: str | None) -> None:
        self.api_keys.check(credentials or "")

    def model_ready(self, name: str, version: str | None = None) -> bool:
        model = self.served.get(name)
        return self.is_ready and model is not None and version in (None, "", model.version)

    def describe(self, name: str | None, version: str | None = None) -> ModelDescription:
        return self.model(name, version).description

    def models(self) -> list[ModelDescription]:
        return [m.description for m in self.served.values()]

    async def infer(self, request: InferenceRequest, encode: Callable[[Inference], T]) -> T:
        model = self.model(request.model, request.version)
        done = await self.run(model, request.inputs, request.options, request.timeout_s)
        with child_span("encode"):
            return await self.run_in_pool(encode, done) if costly_to_encode(done) else encode(done)

    async def repository_index(self, ready_only: bool = False) -> list[ModelStatus]:
        return await self.run_in_pool(self.model_set.index, ready_only)

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        found = self.book.select(name, version)
        if name is not None and not found:
            asked = f"model {name!r}" + (f" version {version!r}" if version is not None else "")
            raise ModelNotFound(f"{asked} has no statistics: it has never served here; known: {self.model_set.names()}")
        return found

    async def load_model(self, name: str) -> None:
        await self.model_set.load(name)

    async def unload_model(self, name: str) -> None:
        await self.model_set.unload(name)

    # The core's own entry, for a model already looked up.
    async def run(
        self,
        model: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None = None,
    ) -> Inference:
        """Predictions for image files (as sent, or decoded by a front-end), or for preprocessed pixels
        (N, C, H, W), in input order; from the response cache where it holds them (VIT_CACHE_BYTES).

        A model replaced since it was looked up answers with its new version; one unloaded since, not at
        all. `timeout_s` shortens VIT_REQUEST_TIMEOUT_S (a gRPC client's deadline).
        """
        if self.cache is None or len(inputs) == 0:
            return await self.compute(model, inputs, options, timeout_s)
        return await self.cached(self.cache, model, inputs, options, timeout_s)

    async def cached(
        self,
        cache: PredictionCache,
        model: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None,
    ) -> Inference:
        """`compute` for the images the cache lacks; the others from it, under this request's file names."""
        started = time.monotonic()
        # SHA-256 takes about 0.7 ms per MB here: past 256 KB, on the pool
        if isinstance(inputs, torch.Tensor):
            large = inputs.numel() * inputs.element_size() > 1 << 18
            digests = await self.run_in_pool(digest_pixels, inputs) if large else digest_pixels(inputs)
            names = [f"pixels[{i}]" for i in range(len(inputs))]
        else:
            large = sum(len(i.data) for i in inputs) > 1 << 18
            files = list(inputs)
            digests = await self.run_in_pool(digest_images, files) if large else digest_images(files)
            names = [i.filename for i in inputs]
        model = self.model_set.current(model)
        target = model.target_index(options.target)
        keys = [cache.key(model.name, model.version, options, target, d) for d in digests]
        claims = cache.claim(model.name, keys)
        looked_up = time.monotonic() - started
        mine = [i for i, c in enumerate(claims) if c.mine]
        found: dict[int, Prediction] = {i: c.hit for i, c in enumerate(claims) if c.hit is not None}
        try:
            if mine:
                done = await self.compute(model, pick(inputs, mine), options, timeout_s)
                if done.model.version != model.version:  # replaced meanwhile: nothing of the old version is kept
                    raise VersionChanged
                for i, p in zip(mine, done.predictions, strict=True):
                    cache.fulfil(keys[i], p)
                    found[i] = p
        except VersionChanged:
            for i in mine:
                cache.abandon(keys[i])
            return await self.compute(model, inputs, options, timeout_s)
        except BaseException:
            for i in mine:
                cache.abandon(keys[i])
            raise
        waits = {i: c.wait for i, c in enumerate(claims) if c.wait is not None}
        again: list[int] = []  # waited for, then computed here: their computation was abandoned
        if waits:  # computed by other requests under way
            limit = (
                self.settings.request_timeout_s
                if timeout_s is None
                else min(timeout_s, self.settings.request_timeout_s)
            )
            try:
                results = await asyncio.wait_for(
                    asyncio.gather(*(asyncio.shield(f) for f in waits.values()), return_exceptions=True), limit
                )
            except TimeoutError:
                raise RequestTimeout(TIMED_OUT) from None
            answered = dict(zip(waits, results, strict=True))
            found |= {i: r for i, r in answered.items() if isinstance(r, Prediction)}
            again = [i for i, r in answered.items() if not isinstance(r, Prediction)]
            if again:
                # the request computing them failed or left: computed here (its error, if any, is this one's too)
                done = await self.compute(model, pick(inputs, again), options, timeout_s)
                found |= dict(zip(again, done.predictions, strict=True))
        predictions = [dataclasses.replace(found[i], filename=name) for i, name in enumerate(names)]
        stats = self.book.of(model.name, model.version)
        hits = len(keys) - len(mine)
        per_image = looked_up / len(keys)
        stats.cache_hit.add(per_image * hits, count=hits)
        stats.cache_miss.add(per_image * len(mine), count=len(mine))
        if mine or again:
            stats.inference_count += hits - len(again)  # the computed ones are counted by `compute`
        else:  # answered from the cache alone: a request of its own
            stats.answered(len(keys), time.monotonic() - started)
        return Inference(model.description, predictions)

    async def compute(
        self,
        model: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None = None,
    ) -> Inference:
        """`run` without the cache, counted in the model version's statistics."""
        model = self.model_set.current(model)  # no await from here until the batcher has admitted the request
        stats = self.book.of(model.name, model.version)
        started = time.monotonic() - decoded_before(inputs)
        attributes: dict[str, AttributeValue] = {
            "vit.model.name": model.name,
            "vit.model.version": model.version,
            "vit.backend": model.description.backend,
            "vit.device": model.description.device,
            "vit.images": len(inputs),
        }
        try:
            with child_span("infer", attributes):
                done, timing = await self.computed(model, inputs, options, timeout_s, started)
        except Exception:
            stats.fail.add(time.monotonic() - started)
            raise
        stats.answered(len(done.predictions), time.monotonic() - started)
        stats.queue.add(timing.queue)
        stats.compute_input.add(timing.compute_input)
        stats.compute_infer.add(timing.compute_infer)
        stats.compute_output.add(timing.compute_output)
        return done

    async def computed(
        self,
        model: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None,
        started: float,
    ) -> tuple[Inference, RequestTiming]:
        wanted = Wanted(options.attention, model.target_index(options.target), options.embedding)
        timeout = self.settings.request_timeout_s
        deadline = time.monotonic() + (timeout if timeout_s is None else min(timeout_s, timeout))
        if isinstance(inputs, torch.Tensor):
            if options.overlay:
                raise InvalidInput("an overlay is drawn over the image file: send images, not pixels")
            if tuple(inputs.shape[1:]) != model.input_shape:  # checked by the edge against a replaced version
                raise InvalidInput(
                    f"model {model.name} (version {model.version}) takes pixels of shape "
                    f"[-1, {', '.join(map(str, model.input_shape))}], got {list(inputs.shape)}"
                )
            submitted = time.monotonic()
            outputs = await model.run_pixels(inputs, wanted, deadline)
            received = time.monotonic()
            names = [f"pixels[{i}]" for i in range(len(outputs))]
            predictions = [prediction(n, o, None, options.normalize) for n, o in zip(names, outputs, strict=True)]
        else:
            prepared, outputs, submitted = await model.run_images(
                inputs, wanted, options.overlay, self.cpu_pool, deadline
            )
            received = time.monotonic()
            if options.overlay:  # PNG encoding of every map: milliseconds each, on the pool
                predictions = await self.run_in_pool(with_overlays, prepared, outputs, options.normalize)
            else:
                predictions = [
                    prediction(p.filename, o, None, options.normalize) for p, o in zip(prepared, outputs, strict=True)
                ]
        record_span("queue", submitted, max((o.batch.started for o in outputs if o.batch), default=submitted))
        timing = request_timing(started, submitted, received, time.monotonic(), outputs)
        return Inference(model.description, predictions), timing

    async def run_in_pool(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the CPU pool, so the event loop only parses, awaits and writes."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)

    def begin_drain(self) -> None:
        """Turn unready for every protocol at once: the first step of shutdown. Requests the edges accepted
        are still taken until `shutdown`."""
        self.is_ready = False
        self.metrics.ready.set(0)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Turn unready, answer every accepted image of every model (within `timeout_s`, default
        VIT_DRAIN_TIMEOUT_S), then stop."""
        self.begin_drain()
        self.taking_requests = False
        await self.model_set.close()  # a change under way finishes first
        timeout = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        if not self.started:  # loaded, never served: nothing was admitted
            timeout = 0.0
        drained = await asyncio.gather(*(m.batcher.drain(timeout) for m in self.served.values()))
        for model, ok in zip(self.served.values(), drained, strict=True):
            if not ok and self.started:
                queued = model.batcher.queue_depth
                log.warning("model %s: drain timed out after %.1fs with %d images queued", model.name, timeout, queued)
            await model.batcher.stop()
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)
        if self.started:
            self.metrics.unwatch_gc()
        if self.froze_heap:
            gc.unfreeze()  # back to the collector: the program may go on (the batch runner's caller, a test)


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


def request_timing(
    started: float, submitted: float, received: float, done: float, outputs: list[ImageOutput]
) -> RequestTiming:
    """Where a request's time went (app.core.statistics): it waits for the slowest of its batches."""
    batches = [o.batch for o in outputs if o.batch is not None]
    if not batches:
        return RequestTiming(0.0, submitted - started, received - submitted, done - received)
    return RequestTiming(
        queue=max(0.0, max(b.started for b in batches) - submitted),
        compute_input=(submitted - started) + max(b.input_s for b in batches),
        compute_infer=max(b.infer_s for b in batches),
        compute_output=max(b.output_s for b in batches) + (done - received),
    )


def decoded_before(inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor) -> float:
    """The time a front-end spent decoding a request's images before it reached the engine (they decode
    together: the longest)."""
    if isinstance(inputs, torch.Tensor):
        return 0.0
    return max((i.decode_s for i in inputs if isinstance(i, DecodedImage)), default=0.0)


class VersionChanged(Exception):
    """The model was replaced while a request's images were computed."""


def pick(
    inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor, indices: list[int]
) -> list[EncodedImage | DecodedImage] | torch.Tensor:
    if isinstance(inputs, torch.Tensor):
        return inputs[indices]
    return [inputs[i] for i in indices]


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
