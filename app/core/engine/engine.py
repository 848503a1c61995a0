"""The engine: the data plane whose compute step runs in this process, owning every served model,
readiness and shutdown.

`Engine.load` builds it whole (models loaded and warm); `start` runs it on the event loop, `shutdown`
answers what it admitted and stops; `Engine.serving` does all three around a block. Edges reach it only
through the `DataPlane` members (written once in `app.core.front`); the rest (`model`, `run`, `served`,
`model_set`) is the core's own.

A request's path here, each step adding one thing: `run` answers from the response cache what it holds,
`counted` counts the rest in the version's statistics, `predicted` takes them through the model's batcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from opentelemetry.util.types import AttributeValue

from app.core.backends.predictor import ImageOutput
from app.core.batcher import Group
from app.core.contract.data_plane import Inference, InferenceRequest
from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport, canonical_version
from app.core.contract.errors import NOT_READY, InvalidInput, ModelNotFound, NotReady
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions, Prediction, pick
from app.core.engine.cache import PredictionCache, digest_images, digest_pixels
from app.core.engine.model_set import ModelSet
from app.core.engine.repository import Repository
from app.core.engine.scoring import labelled_predictions, scored
from app.core.engine.served_model import ServedModel, Wanted, expire, prepared_input
from app.core.engine.shadow_traffic import ShadowTraffic
from app.core.engine.startup_checks import check_shadows, check_thresholds, startup_models
from app.core.engine.timing import decoded_before, request_timing
from app.core.front import Front
from app.core.images.overlay import with_overlays
from app.settings import Settings
from app.telemetry.metrics import Metrics, ModelMetrics
from app.telemetry.spans import child_span, record_span, sampled
from app.telemetry.statistics import ModelStatistics, RequestTiming, StatisticsBook
from model.device import cuda_unavailable_reason, resolve_device

log = logging.getLogger("app")


class Engine(Front):
    """A `DataPlane` whose compute step runs in this process, on the models it owns."""

    def __init__(
        self, settings: Settings, metrics: Metrics, models: ModelSet, statistics: StatisticsBook | None = None
    ) -> None:
        super().__init__(settings, metrics, cpu_threads=8)
        self.book = statistics or StatisticsBook()
        self.model_set = models
        self.cache = PredictionCache(settings.cache_bytes, metrics) if settings.cache_bytes else None
        self.is_ready = False  # what readiness probes are told
        self.taking_requests = False  # whether requests are taken (also while draining)
        self.started = False
        self.froze_heap = False  # by `start`, for its owner
        self.shadowing = ShadowTraffic(self, settings, metrics)
        check_shadows(self.shadowing.shadows, models.served)
        check_thresholds(settings, models.served)

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
        served = self.served.get(name) if name is not None else self.default
        if served is not None and (version is None or version == served.version):  # a front-end's call: as named
            return served
        return self.served[self.describe(name, version).name]

    def start(self, freeze_heap: bool = False) -> None:
        """Start every model's batcher; ready once all are loaded, warm and running.

        With `freeze_heap`, asked by the process's owner (`python -m app`, the engine process, the batch
        runner), everything alive now (torch, the models) is collected once and frozen until shutdown: no
        longer walked by each full collection, which under load stopped every thread long enough to make the
        p99 (see vit_gc_pause_seconds). An engine inside another program (an in-process app, a test)
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

    # The Front's compute step.
    def models(self) -> list[ModelDescription]:
        return [m.description for m in self.served.values()]

    def ready(self) -> bool:
        return self.is_ready

    def check_serving(self) -> None:
        if not self.taking_requests:
            raise NotReady(NOT_READY)

    async def compute(self, model: ModelDescription, request: InferenceRequest) -> Inference:
        if request.texts is not None:
            return await self.embed_texts(self.served[model.name], request.texts)
        return await self.run(self.served[model.name], request.inputs, request.options, request.timeout_s)

    async def embed_texts(self, model: ServedModel, texts: tuple[str, ...]) -> Inference:
        """A zero-shot model's embeddings of `texts` as they are (no template), unit length: with its images'
        (normalize=true), what image-to-text retrieval compares."""
        model = self.model_set.current(model)
        model.description.check_texts(texts)
        assert model.labels is not None
        embedded = await model.labels.of("{}", texts, self.run_in_pool)
        return Inference(model.description, [], text_embeddings=embedded)

    async def repository_index(self, ready_only: bool = False) -> list[ModelStatus]:
        return await self.run_in_pool(self.model_set.index, ready_only)

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        found = self.book.select(name, canonical_version(version) if version else version)
        if name is not None and not found:
            asked = f"model {name!r}" + (f" version {version!r}" if version is not None else "")
            raise ModelNotFound(f"{asked} has no statistics: it has never served here; known: {self.model_set.names()}")
        return found

    async def load_model(self, name: str) -> None:
        await self.model_set.load(name)

    async def unload_model(self, name: str) -> None:
        await self.model_set.unload(name)

    # A request's path, for a model already looked up: the cache, then statistics, then the batcher.
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
            return await self.counted(model, inputs, options, timeout_s)
        started = time.monotonic()
        # hashing a large request holds the loop: past 256 KB, on the pool
        if isinstance(inputs, torch.Tensor):
            large = inputs.numel() * inputs.element_size() > 1 << 18
            digests = await self.run_in_pool(digest_pixels, inputs) if large else digest_pixels(inputs)
            names = [f"pixels[{i}]" for i in range(len(inputs))]
        else:
            large = sum(len(i.data) for i in inputs) > 1 << 18
            digests = await self.run_in_pool(digest_images, list(inputs)) if large else digest_images(inputs)
            names = [i.filename for i in inputs]
        model = self.model_set.current(model)  # replaced while the digests were taken: its successor answers
        target = model.target_index(options.target, options.labels)
        keys = self.cache.keys(model.name, model.version, options, target, digests)
        looked_up = time.monotonic() - started

        async def compute(indices: list[int]) -> list[Prediction]:
            done = await self.counted(model, pick(inputs, indices), options, timeout_s)
            if done.model.version != model.version:  # replaced meanwhile: nothing of the old version is kept
                raise VersionChanged
            return done.predictions

        try:
            found = await self.cache.through(model.name, keys, compute, self.time_limit(timeout_s))
        except VersionChanged:
            return await self.counted(model, inputs, options, timeout_s)
        stats = self.book.of(model.name, model.version)
        per_image = looked_up / len(keys)
        stats.cache_hit.add(per_image * found.hits, count=found.hits)
        stats.cache_miss.add(per_image * found.misses, count=found.misses)
        if found.computed:
            stats.inference_count += found.hits - found.recomputed  # the computed ones are counted by `counted`
        else:  # answered from the cache alone: a request of its own
            stats.answered(len(keys), time.monotonic() - started)
        predictions = [dataclasses.replace(p, filename=name) for p, name in zip(found.predictions, names, strict=True)]
        return Inference(model.description, predictions, options.labels)

    async def counted(
        self,
        model: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None = None,
    ) -> Inference:
        """`predicted`, counted in the model version's statistics under an `infer` span."""
        while True:  # a zero-shot model's label embeddings (no wait where they are kept), for the version serving
            model = self.model_set.current(model)
            texts = None if model.labels is None else await self.label_embeddings(model, options)
            if not model.retired:
                break
        # no await from here until the batcher has admitted the request
        stats = self.book.of(model.name, model.version)
        started = time.monotonic() - decoded_before(inputs)
        attributes: dict[str, AttributeValue] | None = None
        if sampled():  # made for a span alone: this runs for every request
            attributes = {
                "vit.model.name": model.name,
                "vit.model.version": model.version,
                "vit.backend": model.description.backend,
                "vit.device": model.description.device,
                "vit.images": len(inputs),
            }
        try:
            with child_span("infer", attributes):
                done, timing = await self.predicted(model, inputs, options, timeout_s, started, texts)
        except Exception:
            stats.fail.add(time.monotonic() - started)
            raise
        stats.computed(len(done.predictions), time.monotonic() - started, timing)
        return done

    async def predicted(
        self,
        model: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None,
        started: float,
        texts: torch.Tensor | None = None,
    ) -> tuple[Inference, RequestTiming]:
        """Through the model's batcher into predictions (overlays drawn on the pool), and where the time went.
        A zero-shot model's images are scored against `texts`, its request's label embeddings (L, D)."""
        wanted = self.wanted(model, inputs, options, texts)
        deadline = time.monotonic() + self.time_limit(timeout_s)
        if isinstance(inputs, torch.Tensor):
            submitted = time.monotonic()
            outputs = await model.run_pixels(inputs, wanted, deadline)
            received = time.monotonic()
            names = [f"pixels[{i}]" for i in range(len(outputs))]
        else:
            prepared, outputs, submitted = await model.run_images(
                inputs, wanted, options.overlay, self.cpu_pool, deadline
            )
            received = time.monotonic()
            names = [p.filename for p in prepared]
        if texts is not None and outputs:  # zero-shot: each image's embedding compared with the labels'
            predictions = labelled_predictions(model, names, outputs, texts, options)
        else:
            predictions = self.scored(model, names, outputs, options)
        if options.overlay and not isinstance(inputs, torch.Tensor):  # PNG encoding of every map: milliseconds each
            predictions = await self.run_in_pool(with_overlays, predictions, [p.image for p in prepared])
        if (shadow := self.shadowing.sampling(model.name)) is not None:
            self.shadowing.offer(shadow, model, inputs, predictions, received - submitted)
        timing = request_timing(started, submitted, received, time.monotonic(), outputs)
        record_span("queue", submitted, submitted + timing.queue)
        return Inference(model.description, predictions, options.labels), timing

    def wanted(
        self,
        model: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        texts: torch.Tensor | None = None,
    ) -> Wanted:
        """What the batcher computes for each image of a request to `model`; InvalidInput for what it cannot."""
        reference = model.checkpoint.reference
        if options.ood and model.labels is not None:
            raise InvalidInput(
                f"model {model.name} is zero-shot (CLIP, SigLIP): it has no out-of-distribution score, whose reference "
                "statistics are fitted to a classifier's fixed classes"
            )
        if options.ood and reference is None:
            raise InvalidInput(
                f"model {model.name} (version {model.version}) has no reference statistics to score images by; "
                "add them with: python -m model.reference CHECKPOINT --images DIR (in-distribution images)"
            )
        if isinstance(inputs, torch.Tensor):
            if options.overlay:
                raise InvalidInput("an overlay is drawn over the image file: send images, not pixels")
            if tuple(inputs.shape[1:]) != model.input_shape:  # checked by the edge against a replaced version
                raise InvalidInput(
                    f"model {model.name} (version {model.version}) takes pixels of shape "
                    f"[-1, {', '.join(map(str, model.input_shape))}], got {list(inputs.shape)}"
                )
        watched = reference is not None and self.settings.drift_window > 0
        embedding = (options.embedding or options.ood or watched) and texts is None  # zero-shot: the head's output
        target = model.target_index(options.target, options.labels)
        return Wanted(options.attention, target, embedding, texts if options.attention == "gradient" else None)

    def scored(
        self, model: ServedModel, names: list[str], outputs: list[ImageOutput], options: InferOptions
    ) -> list[Prediction]:
        return scored(model, names, outputs, options, self.settings.ood_threshold_for(model.name))

    # The direct lane (the engine process's common request): no coroutine and no task of its own.
    def direct(self, model: ServedModel, options: InferOptions) -> ServedModel | None:
        """The version that would compute a request to `model` with `options` in the direct lane (`submit`), or
        None where it takes the coroutine path (`run`): the response cache, a zero-shot model, an overlay, or a
        shadow that samples. (Whether the request was sampled for a trace is its caller's to check.)"""
        model = self.model_set.current(model)
        if self.cache is not None or model.labels is not None or options.overlay or model.retired:
            return None
        if self.shadowing.sampling(model.name) is not None:
            return None
        return model

    def submit(
        self,
        model: ServedModel,
        inputs: Sequence[DecodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None,
        answer: Callable[[Inference | BaseException], None],
    ) -> asyncio.Future[list[ImageOutput]]:
        """`run` for a model `direct` returned, on pixels or on images prepared for its version: the request
        is queued now, and `answer` is called with its Inference, or with what failed it, from the batch's
        callback. Cancelling the returned future drops the images not yet computed (and answers
        CancelledError). Raises what refuses the request at once (InvalidInput, NotReady, Overloaded)."""
        stats = self.book.of(model.name, model.version)
        now = time.monotonic()
        started = now - decoded_before(inputs)
        deadline = now + self.time_limit(timeout_s)
        try:
            wanted = self.wanted(model, inputs, options)
            if isinstance(inputs, torch.Tensor):
                names = [f"pixels[{i}]" for i in range(len(inputs))]
                payloads = [wanted.input(p) for p in inputs]
            else:
                names = [i.filename for i in inputs]
                payloads = [wanted.input(prepared_input(i)) for i in inputs]
            outputs = model.batcher.submit(payloads, deadline)
        except Exception:
            stats.fail.add(time.monotonic() - started)
            raise
        submitted = time.monotonic()
        timer = asyncio.get_running_loop().call_later(max(0.0, deadline - submitted), expire, outputs)

        def finish(done: asyncio.Future[list[ImageOutput]]) -> None:
            timer.cancel()
            try:
                if done.cancelled():
                    raise asyncio.CancelledError
                computed = done.result()
                received = time.monotonic()
                predictions = self.scored(model, names, computed, options)
                timing = request_timing(started, submitted, received, time.monotonic(), computed)
            except asyncio.CancelledError as e:
                answer(e)
                return
            except Exception as e:
                stats.fail.add(time.monotonic() - started)
                answer(e)
                return
            stats.computed(len(predictions), time.monotonic() - started, timing)
            answer(Inference(model.description, predictions, options.labels))

        outputs.add_done_callback(finish)
        return outputs

    def submit_group(
        self,
        model: ServedModel,
        calls: Sequence[Sequence[DecodedImage]],
        options: InferOptions,
        timeouts: Sequence[float | None],
        answer: Callable[[int, Inference | BaseException], None],
    ) -> Group[ImageOutput] | None:
        """`submit` for several requests to `model` with the same `options`, on images prepared for its version
        (the engine process's calls read together): queued as one `Group`, each request still answered on its
        own, `answer(k, ...)` for request k, as its images are computed. None where they would not all fit in
        the queue: submitted one by one, each has its own answer. Raises what refuses them all at once
        (InvalidInput, NotReady)."""
        stats = self.book.of(model.name, model.version)
        now = time.monotonic()
        started = [now - decoded_before(c) for c in calls]
        deadlines = [now + self.time_limit(t) for t in timeouts]
        counts = [len(c) for c in calls]
        if not model.batcher.fits(sum(counts)):
            return None
        submitted = 0.0  # set once the group is queued: no part is delivered before

        def finish(parts: list[tuple[int, list[ImageOutput] | BaseException]]) -> None:
            """The parts a batch completed (their statistics counted together), or one that ended."""
            received = time.monotonic()
            answers: list[tuple[int, Inference | BaseException]] = []
            images = 0
            seconds = queue = compute_input = compute_infer = compute_output = 0.0
            for k, done in parts:
                if isinstance(done, BaseException):
                    if not isinstance(done, asyncio.CancelledError):
                        stats.fail.add(time.monotonic() - started[k])
                    answers.append((k, done))
                    continue
                try:
                    predictions = self.scored(model, [i.filename for i in calls[k]], done, options)
                    timing = request_timing(started[k], submitted, received, time.monotonic(), done)
                except Exception as e:
                    stats.fail.add(time.monotonic() - started[k])
                    answers.append((k, e))
                    continue
                images += len(predictions)
                seconds += time.monotonic() - started[k]
                queue += timing.queue
                compute_input += timing.compute_input
                compute_infer += timing.compute_infer
                compute_output += timing.compute_output
                answers.append((k, Inference(model.description, predictions, options.labels)))
            if computed := len(answers) - sum(isinstance(a, BaseException) for _, a in answers):
                summed = RequestTiming(queue, compute_input, compute_infer, compute_output)
                stats.computed(images, seconds, summed, computed)
            for k, answered in answers:
                answer(k, answered)

        try:
            wanted = self.wanted(model, calls[0], options)  # for images, the model's and the options' alone
            payloads = [wanted.input(prepared_input(i)) for c in calls for i in c]
            group = model.batcher.submit_group(payloads, counts, deadlines, finish)
        except Exception:  # refused whole: options the model refuses, or the service began to drain
            for s in started:
                stats.fail.add(time.monotonic() - s)
            raise
        submitted = time.monotonic()
        return group

    async def label_embeddings(self, model: ServedModel, options: InferOptions) -> torch.Tensor:
        """A zero-shot request's label embeddings (L, D): its labels (or the model's defaults) in its template (or
        the model's), kept from an earlier request or computed now on the pool."""
        described = model.description
        described.check_labels(options.labels, options.template, options.classify)
        assert model.labels is not None and described.template is not None
        labels = options.labels if options.labels is not None else tuple(described.classes)
        if not labels:  # no probabilities asked for, and none to give: the images' embeddings alone
            return torch.empty(0, model.labels.zero_shot.embed_dim)
        return await model.labels.of(options.template or described.template, labels, self.run_in_pool)

    async def shadow_report(self, champion: str) -> ShadowReport:
        return self.shadowing.report(champion)

    def begin_drain(self) -> None:
        self.is_ready = False
        self.metrics.ready.set(0)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Turn unready, answer every accepted image of every model (within `timeout_s`, default
        VIT_DRAIN_TIMEOUT_S), then stop."""
        self.begin_drain()
        self.taking_requests = False
        self.shadowing.stop()
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
        self.regions.close()
        if self.started:
            self.metrics.unwatch_gc()
        if self.froze_heap:
            gc.unfreeze()  # back to the collector: the program may go on (the batch runner's caller, a test)


class VersionChanged(Exception):
    """The model was replaced while a request's images were computed."""
