"""The one lane every request takes through the engine, as a `Call` (`app.core.engine.call`).

1. `submit`: the way in, from every edge (`run` awaits it for one request; the engine process hands it the
   calls it read together).
2. `steps_first` decides, in one place, whether the call takes steps before the batcher, on a task of its
   own (`stepped`): texts to embed (`embed_texts`), the response cache (`from_cache`), a zero-shot model's
   labels, files to decode here, an overlay, a trace to record (`computed`, `decoded_then_queued`). The
   common call takes none.
3. `queue`: into the model's batcher after `wanted` checks what it asks of the model; each call an entry, or
   several as one group (`queue_group`).
4. `answer`: from the batch's callback, scored, offered to a shadow, overlays drawn, counted once in the
   version's statistics (`failed` for what fails it), and answered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

import torch
from opentelemetry.util.types import AttributeValue

from app.core.backends.predictor import ImageInput, ImageOutput
from app.core.contract.errors import ServiceError
from app.core.contract.inference import Inference
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions, Prediction
from app.core.engine.cache import PredictionCache, digest_images, digest_pixels
from app.core.engine.call import Call, answer_if_never_run, part_of, settle_future
from app.core.engine.model_set import ModelSet
from app.core.engine.scoring import headed_predictions, labelled_predictions, scored
from app.core.engine.served_model import ServedModel, Wanted, expire, prepared_input
from app.core.engine.shadow_traffic import ShadowTraffic
from app.core.engine.timing import decoded_before, request_timing
from app.core.images.overlay import with_overlays
from app.core.images.prepare import Prepared
from app.settings import Settings
from app.telemetry import spans
from app.telemetry.spans import attach, child_span, detach, record_span, sampled, sent_sampled
from app.telemetry.statistics import ModelStatistics, RequestTiming, StatisticsBook

T = TypeVar("T")


class Lane:
    """The request path of an engine: its models (`model_set`), their statistics (`book`), the response cache,
    shadow traffic, and the CPU pool for what would hold the event loop."""

    def __init__(
        self,
        settings: Settings,
        model_set: ModelSet,
        book: StatisticsBook,
        cache: PredictionCache | None,
        shadowing: ShadowTraffic,
        pool: Executor,
    ) -> None:
        self.settings = settings
        self.model_set = model_set
        self.book = book
        self.cache = cache
        self.shadowing = shadowing
        self.pool = pool

    async def run_in_pool(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def submit(self, model: ServedModel, calls: Sequence[Call]) -> None:
        """The one way into the engine, for every edge and whatever a request asks. `calls` go to `model` with
        the same options; several (a front-end's calls read together) enter the batcher as one group where they
        all can. Each is answered through its `answer`, with its Inference or with what failed it."""
        now = time.monotonic()
        model = self.model_set.current(model)
        every = self.steps_for_every_call(model)
        ready = []
        for call in calls:
            call.started = now if call.pixels else now - decoded_before(call.inputs)
            if every or self.steps_first(model, call):
                call.steps = asyncio.ensure_future(self.stepped(model, call))
                call.steps.add_done_callback(functools.partial(answer_if_never_run, call))
            else:
                ready.append(call)
        if ready:
            self.queue(model, ready)

    def steps_for_every_call(self, model: ServedModel) -> bool:
        """Whether every call to `model` takes steps before the batcher: the response cache, a zero-shot model's
        labels, or a version replaced since it was looked up."""
        return self.cache is not None or model.labels is not None or model.retired

    def steps_first(self, model: ServedModel, call: Call) -> bool:
        """Whether `call` takes steps before its images are queued, on a task of its own, beyond those every call
        to the model takes (`steps_for_every_call`): texts to embed, an overlay (its images decoded here), a trace
        to record, or files not prepared for the version serving. Every other call is queued as it comes and
        answered from its batch's callback."""
        if call.texts is not None or call.options.overlay:
            return True
        if spans.recording and (sampled() if call.trace is None else sent_sampled(call.trace)):
            return True
        return not call.pixels and not all(model.prepared_for(i) for i in call.inputs)

    async def run(
        self,
        model: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None = None,
        texts: tuple[str, ...] | None = None,
    ) -> Inference:
        """`submit` for one request, awaited: predictions for image files (as sent, or decoded by a front-end),
        or for preprocessed pixels (N, C, H, W), in input order; or a zero-shot model's embeddings of `texts`.
        A model replaced since it was looked up answers with its new version; one unloaded since, not at all."""
        future: asyncio.Future[Inference] = asyncio.get_running_loop().create_future()
        call = Call(inputs, options, timeout_s, functools.partial(settle_future, future), texts=texts)
        self.submit(model, [call])
        try:
            return await future
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def stepped(self, model: ServedModel, call: Call) -> None:
        """A call's steps before the batcher, under its trace context, then its answer."""
        token = attach(call.trace)  # the engine's spans go under the front-end's request span
        try:
            if call.texts is not None:
                done = await self.embed_texts(model, call.texts)
            elif self.cache is not None and len(call.inputs) > 0:
                done = await self.from_cache(model, call)
            else:
                done = await self.computed(model, call)
        except BaseException as e:  # cancelled, a core error, or a fault
            call.settle(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        else:
            call.settle(done)
        finally:
            detach(token)

    async def from_cache(self, model: ServedModel, call: Call) -> Inference:
        """The response cache's step (VIT_CACHE_BYTES): the images it holds answered from it, the others
        computed, each image once however many requests ask for it at the same time."""
        inputs, options = call.inputs, call.options
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
        # a head's answers are those of the head serving now: one taught again under its name is another
        stamp = model.version if options.head is None else f"{model.version}/{model.head(options.head).digest}"
        keys = self.cache.keys(model.name, stamp, options, target, digests)  # type: ignore[union-attr]
        looked_up = time.monotonic() - started

        async def compute(indices: list[int]) -> list[Prediction]:
            done = await self.computed(model, part_of(call, indices))
            if done.model.version != model.version:  # replaced meanwhile: nothing of the old version is kept
                raise VersionChanged
            return done.predictions

        try:
            found = await self.cache.through(model.name, keys, compute, self.settings.time_limit(call.timeout_s))  # type: ignore[union-attr]
        except VersionChanged:
            return await self.computed(model, call)
        stats = self.book.of(model.name, model.version)
        per_image = looked_up / len(keys)
        stats.cache_hit.add(per_image * found.hits, count=found.hits)
        stats.cache_miss.add(per_image * found.misses, count=found.misses)
        if found.computed:
            stats.inference_count += found.hits - found.recomputed  # the computed ones are counted by `answer`
        else:  # answered from the cache alone: a request of its own
            stats.answered(len(keys), time.monotonic() - started)
        predictions = [dataclasses.replace(p, filename=name) for p, name in zip(found.predictions, names, strict=True)]
        return Inference(model.description, predictions, model.description.answer_labels(options))

    async def computed(self, model: ServedModel, call: Call) -> Inference:
        """A call's images through the batcher, under an `infer` span: for the version serving, with a zero-shot
        model's label embeddings, its files decoded here first (within the room the batcher holds for them)
        where a front-end did not prepare them or an overlay needs the image."""
        while True:  # a zero-shot model's label embeddings (no wait where they are kept), for the version serving
            model = self.model_set.current(model)
            model.check_scores(call.options)  # refused before its labels cost the text tower anything
            labelled = model.labels is not None and call.options.head is None
            texts = await model.label_embeddings(call.options, self.run_in_pool) if labelled else None
            if not model.retired:
                break
        future: asyncio.Future[Inference] = asyncio.get_running_loop().create_future()
        inner = Call(call.inputs, call.options, call.timeout_s, functools.partial(settle_future, future))
        inner.started = call.started
        attributes: dict[str, AttributeValue] | None = None
        if sampled():  # made for a span alone
            attributes = {
                "vit.model.name": model.name,
                "vit.model.version": model.version,
                "vit.backend": model.description.backend,
                "vit.device": model.description.device,
                "vit.images": len(call.inputs),
            }
        with child_span("infer", attributes):
            inputs = call.inputs
            if isinstance(inputs, torch.Tensor):
                self.queue(model, [inner], texts)
            else:  # files: those a front-end prepared are taken as they are
                await self.decoded_then_queued(model, inner, inputs, texts)
            try:
                return await future
            except asyncio.CancelledError:
                inner.cancel()
                raise

    async def decoded_then_queued(
        self, model: ServedModel, call: Call, inputs: Sequence[EncodedImage | DecodedImage], texts: torch.Tensor | None
    ) -> None:
        """All of a call's files decoded on the pool first, so a bad one fails the request before any compute,
        within the room the batcher holds for them (refused before any CPU is spent when it has none)."""
        asked = time.monotonic()
        try:
            with model.batcher.admit(len(inputs)) as admission:
                if sampled():
                    record_span("admission", asked, time.monotonic(), {"vit.images": len(inputs)})
                prepared = await model.prepare_all(inputs, call.options.overlay, self.pool)
                self.queue(model, [call], texts, prepared, admission.submit)
        except Exception as e:
            self.failed(self.book.of(model.name, model.version), call, e)

    def queue(
        self,
        model: ServedModel,
        calls: Sequence[Call],
        texts: torch.Tensor | None = None,
        prepared: list[Prepared] | None = None,
        enqueue: Callable[[list[ImageInput], float], asyncio.Future[list[ImageOutput]]] | None = None,
    ) -> None:
        """Calls whose steps are done into the model's batcher, each answered by `answer` from its batch's
        callback: several as one group where they all fit, else each as an entry of its own."""
        stats = self.book.of(model.name, model.version)
        if len(calls) > 1 and model.batcher.fits(sum(len(c.inputs) for c in calls)):
            self.queue_group(model, calls, stats)
            return
        loop = asyncio.get_running_loop()
        for call in calls:
            try:
                wanted = self.wanted(model, call.inputs, call.options, texts)
                deadline = time.monotonic() + self.settings.time_limit(call.timeout_s)
                outputs = (enqueue or model.batcher.submit)(payloads(wanted, call.inputs, prepared), deadline)
            except Exception as e:  # refused at once: options the model cannot take, no room, draining
                self.failed(stats, call, e)
                continue
            submitted = time.monotonic()
            timer = loop.call_later(max(0.0, deadline - submitted), expire, outputs)
            call.queued = outputs.cancel

            def finish(
                done: asyncio.Future[list[ImageOutput]],
                call: Call = call,
                timer: Any = timer,
                submitted: float = submitted,
            ) -> None:
                timer.cancel()
                if done.cancelled():
                    call.settle(asyncio.CancelledError())
                elif (error := done.exception()) is not None:
                    self.failed(stats, call, error)
                else:
                    self.answer(model, call, stats, done.result(), submitted, texts, prepared)

            outputs.add_done_callback(finish)

    def queue_group(self, model: ServedModel, calls: Sequence[Call], stats: ModelStatistics) -> None:
        """Calls to one model with the same options, on files prepared for its version, queued as one group;
        each still answered on its own as its images are computed."""
        now = time.monotonic()
        submitted = [now]  # set once the group is queued: no part is delivered before
        try:
            wanted = self.wanted(model, calls[0].inputs, calls[0].options)  # files: the model's and options' alone
            group = model.batcher.submit_group(
                [p for c in calls for p in payloads(wanted, c.inputs)],
                [len(c.inputs) for c in calls],
                [now + self.settings.time_limit(c.timeout_s) for c in calls],
                functools.partial(self.answer_parts, model, calls, stats, submitted),
            )
        except Exception as e:  # refused whole: options the model refuses, or the service began to drain
            for call in calls:
                self.failed(stats, call, e)
            return
        submitted[0] = time.monotonic()
        for k, call in enumerate(calls):
            call.queued = functools.partial(group.cancel, k)

    def answer_parts(
        self,
        model: ServedModel,
        calls: Sequence[Call],
        stats: ModelStatistics,
        submitted: list[float],
        parts: list[tuple[int, list[ImageOutput] | BaseException]],
    ) -> None:
        """The parts of a group a batch completed (counted together), or one that ended."""
        received = time.monotonic()
        answers: list[tuple[Call, Inference]] = []
        images = 0
        seconds = queue = compute_input = compute_infer = compute_output = 0.0
        for k, done in parts:
            call = calls[k]
            if isinstance(done, BaseException):
                self.failed(stats, call, done)
                continue
            try:
                predictions = self.predictions(model, call, done, received - submitted[0])
                timing = request_timing(call.started, submitted[0], received, time.monotonic(), done)
            except Exception as e:
                self.failed(stats, call, e)
                continue
            images += len(predictions)
            seconds += time.monotonic() - call.started
            queue += timing.queue
            compute_input += timing.compute_input
            compute_infer += timing.compute_infer
            compute_output += timing.compute_output
            answers.append(
                (call, Inference(model.description, predictions, model.description.answer_labels(call.options)))
            )
        if answers:
            summed = RequestTiming(queue, compute_input, compute_infer, compute_output)
            stats.computed(images, seconds, summed, len(answers))
        for call, answered in answers:
            call.settle(answered)

    def predictions(
        self,
        model: ServedModel,
        call: Call,
        outputs: list[ImageOutput],
        computing_s: float,
        texts: torch.Tensor | None = None,
        prepared: list[Prepared] | None = None,
    ) -> list[Prediction]:
        """A call's predictions from its computed outputs: scored (a zero-shot model's against `texts`, its
        request's label embeddings), and offered to the model's shadow challenger."""
        if call.pixels:
            names = [f"pixels[{i}]" for i in range(len(outputs))]
        else:
            names = [p.filename for p in prepared] if prepared is not None else [i.filename for i in call.inputs]
        if call.options.head is not None and outputs:  # a head taught by example, over the embeddings
            predictions = headed_predictions(model, call.options.head, names, outputs, call.options)
        elif texts is not None and outputs:  # zero-shot: each image's embedding compared with the labels'
            predictions = labelled_predictions(model, names, outputs, texts, call.options)
        else:
            predictions = self.scored(model, names, outputs, call.options)
        # a shadow compares the model's own classes: a head's answers are over others
        if call.options.head is None and (shadow := self.shadowing.sampling(model.name)) is not None:
            self.shadowing.offer(shadow, model, call.inputs, predictions, computing_s)
        return predictions

    def answer(
        self,
        model: ServedModel,
        call: Call,
        stats: ModelStatistics,
        outputs: list[ImageOutput],
        submitted: float,
        texts: torch.Tensor | None,
        prepared: list[Prepared] | None,
    ) -> None:
        """A call's answer from its computed outputs (`predictions`), overlays drawn on the pool where asked,
        counted once in the version's statistics."""
        received = time.monotonic()
        try:
            predictions = self.predictions(model, call, outputs, received - submitted, texts, prepared)
            timing = request_timing(call.started, submitted, received, time.monotonic(), outputs)
        except Exception as e:
            self.failed(stats, call, e)
            return
        record_span("queue", submitted, submitted + timing.queue)
        if call.options.overlay and prepared is not None:  # PNG encoding of every map: milliseconds each
            overlaid = asyncio.ensure_future(self.run_in_pool(with_overlays, predictions, [p.image for p in prepared]))
            overlaid.add_done_callback(functools.partial(self.answer_overlaid, model, call, stats, timing))
            call.queued = overlaid.cancel
            return
        stats.computed(len(predictions), time.monotonic() - call.started, timing)
        call.settle(Inference(model.description, predictions, model.description.answer_labels(call.options)))

    def answer_overlaid(
        self,
        model: ServedModel,
        call: Call,
        stats: ModelStatistics,
        timing: RequestTiming,
        overlaid: asyncio.Future[list[Prediction]],
    ) -> None:
        if overlaid.cancelled():
            call.settle(asyncio.CancelledError())
        elif (error := overlaid.exception()) is not None:
            self.failed(stats, call, error)
        else:
            predictions = overlaid.result()
            try:  # a head deleted while the overlays were drawn: not found
                labels = model.description.answer_labels(call.options)
            except ServiceError as e:
                self.failed(stats, call, e)
                return
            stats.computed(len(predictions), time.monotonic() - call.started, timing)
            call.settle(Inference(model.description, predictions, labels))

    def failed(self, stats: ModelStatistics, call: Call, error: BaseException) -> None:
        """A call answered with what failed it, counted as a failure unless it was cancelled."""
        if not isinstance(error, asyncio.CancelledError):
            stats.fail.add(time.monotonic() - call.started)
        call.settle(error)

    def wanted(
        self,
        model: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        texts: torch.Tensor | None = None,
    ) -> Wanted:
        return model.wanted(inputs, options, texts, watch_drift=self.settings.drift_window > 0)

    def scored(
        self, model: ServedModel, names: list[str], outputs: list[ImageOutput], options: InferOptions
    ) -> list[Prediction]:
        return scored(model, names, outputs, options, self.settings.ood_threshold_for(model.name))

    async def embed_texts(self, model: ServedModel, texts: tuple[str, ...]) -> Inference:
        """A zero-shot model's embeddings of `texts` as they are (no template), unit length: with its images'
        (normalize=true), what image-to-text retrieval compares."""
        model = self.model_set.current(model)
        model.description.check_texts(texts)
        assert model.labels is not None
        embedded = await model.labels.of("{}", texts, self.run_in_pool)
        return Inference(model.description, [], text_embeddings=embedded)


class VersionChanged(Exception):
    """The model was replaced while a request's images were computed."""


def payloads(
    wanted: Wanted, inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor, prepared: list[Prepared] | None = None
) -> list[ImageInput]:
    """What the batcher computes for each image of a request: its pixels, a front-end's prepared file, or what
    the engine decoded here (`prepared`)."""
    if prepared is not None:
        return [wanted.input(p.pixels) for p in prepared]
    if isinstance(inputs, torch.Tensor):
        return [wanted.input(p) for p in inputs]
    return [wanted.input(prepared_input(i)) for i in inputs]  # type: ignore[arg-type]
