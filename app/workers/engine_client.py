"""A data plane whose compute step is the engine in another process: what each serving front-end holds
(VIT_WORKERS > 1).

The front-end answers health, model descriptions and API keys from what it holds (the engine's last
`State`, its own settings); `infer` and the repository calls go to the engine (`app.workers.engine_host`).
It decodes and preprocesses a request's images itself, on its own pool, as the model version it asks
prescribes (`ImagePreparer`), so the engine only batches them; it draws the overlays when the answer is
back. The files and their pixels go into a region of this process's shared-memory arena and the outputs
come back in the same region, so the messages carry only offsets. The calls made in one go of the event
loop (and their cancellations) leave together as one message, in order; the engine's replies come back the
same way. With the response cache on, the files go undecoded: the engine decodes only the images its cache
lacks.

When the engine process exits (watched through a pidfd, or after ENGINE_SILENT_S without a word from it),
this front-end is not ready at once and every call waiting on that engine fails with NotReady (503,
UNAVAILABLE); once a new engine answers its hello, it serves again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq
from PIL import Image

from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport
from app.core.contract.errors import LOADING, NOT_READY, TIMED_OUT, NotReady, Overloaded, RequestTimeout
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions
from app.core.contract.teaching import Embedded
from app.core.data_plane import DataPlane
from app.core.images.gpu_decode import Jpeg
from app.core.images.overlay import with_overlays
from app.core.images.prepare import ImagePreparer
from app.settings import Settings
from app.telemetry.metrics import Metrics
from app.telemetry.spans import carrier
from app.telemetry.statistics import ModelStatistics
from app.workers import link
from app.workers.arena import Arena, read_outputs, write_inputs
from model.preprocessing import Preprocessing

log = logging.getLogger("app")
ENGINE_GONE = "not ready: the engine process stopped and is being restarted; retry shortly"
ENGINE_BEHIND = "server overloaded: the engine has not yet read the calls sent to it"


@dataclass(eq=False)
class Pending:
    future: asyncio.Future[link.Reply]
    region: int | None  # the arena offset held until the engine answers
    abandoned: bool = False  # the caller stopped waiting (cancelled): free the region on the answer


class EngineClient(DataPlane):
    """A `DataPlane` over the engine process listening at `address`."""

    def __init__(
        self, settings: Settings, metrics: Metrics, address: str, arena: Arena | None, regions: Path | None = None
    ) -> None:
        super().__init__(settings, metrics, cpu_threads=4, regions=regions)
        self.address = address
        self.arena = arena
        self.context = zmq.Context()
        self.channel: link.Channel | None = None  # once started
        self.state: link.State | None = None  # the engine's, while it is up
        self.heard_at = 0.0
        self.engine_seen = False  # an engine has answered (before: the models are loading)
        self.pending: dict[int, Pending] = {}
        self.outbox: list[link.InferCall | link.Cancel] = []  # sent together, once per go of the event loop
        self.ids = itertools.count()
        self.engine_pidfd: int | None = None
        self.tasks: list[asyncio.Task[None]] = []
        # With the response cache on, the engine decodes: a hit then costs no decoding anywhere.
        self.decodes = settings.cache_bytes == 0
        self.preparers: dict[tuple[str, str], ImagePreparer] = {}  # by model name and version

    async def start(self) -> None:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for an engine not connected
        socket.connect(self.address)
        self.channel = link.Channel(socket, self.receive, "front-end")
        self.tasks = [asyncio.create_task(self.keep_in_touch())]

    async def wait_engine(self, timeout_s: float) -> bool:
        """Whether the engine answered within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.state is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.state is not None

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop: the edges have drained; whatever still waits on the engine fails with NotReady."""
        for task in self.tasks:
            task.cancel()
        self.engine_gone("this front-end is stopping", stopping=True)
        if self.channel is not None:
            self.channel.close()
        self.context.term()
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)
        self.regions.close()
        if self.arena is not None:
            self.arena.unlink()

    # Keeping track of the engine.
    async def keep_in_touch(self) -> None:
        """Say hello until an engine answers (and again after it is gone); notice a silent one."""
        while True:
            if self.state is None:
                self.send(link.Hello(os.getpid(), self.arena.path if self.arena else None))
            elif time.monotonic() - self.heard_at > link.ENGINE_SILENT_S:
                self.engine_gone(f"no word from the engine for {link.ENGINE_SILENT_S:.0f} s")
            await asyncio.sleep(0.1 if self.state is None else link.HEARTBEAT_S)

    def receive(self, sender: bytes | None, message: object) -> None:
        if isinstance(message, link.State):
            self.apply(message)
        elif isinstance(message, list):  # the replies the engine computed in one go
            for reply in message:
                self.answered(reply)
        elif isinstance(message, link.Reply):
            self.answered(message)

    def send(self, message: object) -> bool:
        """Whether `message` went to the engine (not when no engine is connected, or its queue is full)."""
        return self.channel is not None and self.channel.send(message)

    def post(self, message: link.InferCall | link.Cancel) -> None:
        """`message` to the engine with the others posted in this go of the event loop, as one message. Calls
        the engine cannot be sent fail: NotReady without an engine, Overloaded when ZeroMQ's queue is full."""
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self.flush)
        self.outbox.append(message)

    def flush(self) -> None:
        messages, self.outbox = self.outbox, []
        if not messages or self.send(messages):
            return
        for message in messages:
            p = self.pending.get(message.id)
            if not isinstance(message, link.InferCall) or p is None:
                continue
            if p.abandoned:  # its caller left before it was sent: no answer will come to free its region
                self.release_call(message.id)
            elif not p.future.done():
                p.future.set_exception(self.unsent())

    def unsent(self) -> Exception:
        """Why a call could not be sent."""
        if self.state is None:
            return NotReady(ENGINE_GONE)
        # connected, but ZeroMQ's queue to the engine is full: the engine is not keeping up
        return Overloaded(f"{ENGINE_BEHIND} ({len(self.pending)} calls under way); retry shortly", 1)

    def apply(self, state: link.State) -> None:
        if self.state is not None and state.incarnation != self.state.incarnation:
            self.engine_gone("the engine was replaced")
        if self.state is None:
            self.engine_seen = True
            self.watch_engine(state.pid)
            log.info("front-end pid %d: connected to the engine (pid %d)", os.getpid(), state.pid)
        changed = self.state is None or state.seq != self.state.seq
        self.state = state
        self.heard_at = time.monotonic()
        if changed:
            serving = {(m.name, m.version) for m in state.models}
            self.preparers = {k: v for k, v in self.preparers.items() if k in serving}
            self.send(link.Ack(state.seq))

    def watch_engine(self, pid: int) -> None:
        try:
            self.engine_pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd (not Linux): the heartbeat's silence tells
            return
        asyncio.get_running_loop().add_reader(self.engine_pidfd, self.engine_gone, "the engine process exited")

    def engine_gone(self, why: str, stopping: bool = False) -> None:
        """Not ready; every call waiting on the engine fails with NotReady."""
        if self.engine_pidfd is not None:
            asyncio.get_running_loop().remove_reader(self.engine_pidfd)
            os.close(self.engine_pidfd)
            self.engine_pidfd = None
        if self.state is not None and (self.pending or not stopping):
            log.warning("engine unavailable: %s; %d calls failed", why, len(self.pending))
        self.state = None
        for call_id, p in list(self.pending.items()):
            if p.future.done() and not p.abandoned:
                continue  # answered: its caller reads the outputs, then frees the region
            del self.pending[call_id]
            self.release(p)
            if not p.future.done():
                p.future.set_exception(NotReady(ENGINE_GONE))

    def answered(self, reply: link.Reply) -> None:
        p = self.pending.get(reply.id)
        if p is None:
            return
        if p.abandoned:
            del self.pending[reply.id]
            self.release(p)
        elif not p.future.done():
            p.future.set_result(reply)

    def release(self, p: Pending) -> None:
        if p.region is not None and self.arena is not None:
            self.arena.free(p.region)
            p.region = None

    # The DataPlane's compute step.
    def ready(self) -> bool:
        return self.state is not None and self.state.ready and not self.draining

    def check_taking(self) -> None:
        if self.state is None:
            raise NotReady(ENGINE_GONE if self.engine_seen else LOADING)
        if not self.state.taking_requests:
            raise NotReady(NOT_READY)

    def models(self) -> list[ModelDescription]:
        return list(self.state.models) if self.state is not None else []

    async def compute(self, request: InferenceRequest) -> Inference:
        """Decoded here (unless the engine's cache decodes), computed by the engine, overlays drawn here."""
        inputs, options, timeout_s = request.inputs, request.options, request.timeout_s
        images: list[Image.Image | None] = []  # for the overlays drawn here
        if self.decodes and not isinstance(inputs, torch.Tensor) and request.texts is None:
            started = time.monotonic()
            inputs, images = await self.decode(request.model, inputs, options.overlay, started)
            timeout_s = self.settings.time_limit(timeout_s) - (time.monotonic() - started)
            if timeout_s <= 0:
                raise RequestTimeout(TIMED_OUT)
            options = dataclasses.replace(options, overlay=False)  # drawn here
        done = await self.computed(request, inputs, options, timeout_s)
        if any(image is not None for image in images):  # PNG encoding of every map: milliseconds each
            done = Inference(done.model, await self.run_in_pool(with_overlays, done.predictions, images), done.labels)
        return done

    async def computed(
        self,
        request: InferenceRequest,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        timeout_s: float | None,
    ) -> Inference:
        """`request` computed by the engine, on `inputs` (its own, or decoded here) with `options` and `timeout_s`:
        its inputs in, its outputs back, through a region of the arena."""
        if self.state is None:  # gone while this front-end decoded
            raise NotReady(ENGINE_GONE)
        model = request.model
        texts = len(request.texts) if request.texts is not None else 0
        stored = write_inputs(self.arena, inputs, model, options, texts)
        call = link.InferCall(
            next(self.ids),
            self.state.incarnation,
            model.name,
            request.version,
            options,
            timeout_s,
            stored.images,
            stored.pixels,
            stored.region,
            model.version,
            carrier(),
            request.texts,
        )
        offset = None if stored.region is None else stored.region[0]
        reply = await self.call(call, offset, self.settings.request_timeout_s + 5)
        try:
            if reply.failure is not None:
                raise reply.failure.exception()
            assert reply.outputs is not None
            if reply.cpu_decode_share is not None:  # the engine moved it (auto): the next files go its way
                self.preparer(model).set_cpu_share(reply.cpu_decode_share)
            predictions, embedded = read_outputs(self.arena, reply.outputs)
            answered_by = reply.model or model
            labels = reply.labels if reply.labels is not None else answered_by.answer_labels(options)
            return Inference(answered_by, predictions, labels, embedded)
        finally:
            self.release_call(call.id)

    async def decode(
        self, model: ModelDescription, files: Sequence[EncodedImage | DecodedImage], keep_images: bool, started: float
    ) -> tuple[list[DecodedImage], list[Image.Image | None]]:
        """Each file decoded, checked and preprocessed for `model` on this process's pool, all at once; and
        the images themselves when overlays are drawn. A file refused is counted as the model's failure."""
        try:
            prepared = await self.preparer(model).prepare_all(files, keep_images, self.cpu_pool)
        except Exception:
            if self.state is not None:
                self.send(link.Refused(self.state.incarnation, model.name, model.version, time.monotonic() - started))
            raise
        took = time.monotonic() - started
        decoded = [
            DecodedImage(f.filename, f.data, model.version, None if isinstance(p.pixels, Jpeg) else p.pixels, took)
            for f, p in zip(files, prepared, strict=True)
        ]
        return decoded, [p.image for p in prepared]

    def preparer(self, model: ModelDescription) -> ImagePreparer:
        """How `model` (this version) prepares a file, as the engine would."""
        key = (model.name, model.version)
        if (preparer := self.preparers.get(key)) is None:
            s = self.settings
            p = Preprocessing(**model.preprocessing)
            gpu_jpegs = model.decode == "gpu"
            share = s.cpu_decode_share_start if s.cpu_decode_share == "auto" else s.cpu_decode_share
            on_gpu = model.device.startswith("cuda")  # pixels go as uint8, normalised there with their batch
            preparer = ImagePreparer(p, s.max_image_pixels, s.jpeg_draft, gpu_jpegs, share, uint8=on_gpu)
            self.preparers[key] = preparer
        return preparer

    async def call(
        self, message: link.InferCall | link.RepositoryCall, region: int | None, timeout_s: float
    ) -> link.Reply:
        """Send `message`, wait for the engine's answer. Cancelled (the client went away), the engine is
        told to stop; the region stays held until the engine has answered."""
        future: asyncio.Future[link.Reply] = asyncio.get_running_loop().create_future()
        pending = Pending(future, region)
        self.pending[message.id] = pending
        try:
            if isinstance(message, link.InferCall):
                self.post(message)
            elif not self.send(message):
                raise self.unsent()
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except (asyncio.CancelledError, TimeoutError) as e:
            if future.done():  # answered, or never sent: no answer is coming that would free the region
                future.exception()  # read: a call never sent is not logged as an error nobody retrieved
                self.release_call(message.id)
            elif message.id in self.pending:
                pending.abandoned = True
                if isinstance(message, link.InferCall):
                    self.post(link.Cancel(message.id, message.incarnation))
                else:
                    self.send(link.Cancel(message.id, message.incarnation))
            if isinstance(e, TimeoutError):
                raise RequestTimeout(f"the engine did not answer within {timeout_s:.0f} s") from None
            raise
        except BaseException:
            self.release_call(message.id)
            raise

    def release_call(self, call_id: int) -> None:
        p = self.pending.pop(call_id, None)
        if p is not None:
            self.release(p)

    async def repository(
        self,
        op: str,
        name: str | None = None,
        ready_only: bool = False,
        version: str | None = None,
        embedded: Embedded | None = None,
        head: str | None = None,
    ) -> link.Reply:
        self.check_serving()
        assert self.state is not None
        call = link.RepositoryCall(
            next(self.ids), self.state.incarnation, op, name, ready_only, version, embedded, head
        )
        reply = await self.call(call, None, self.settings.request_timeout_s + 600)  # a load may take minutes
        self.release_call(call.id)
        if reply.failure is not None:
            raise reply.failure.exception()
        return reply

    async def repository_index(self, ready_only: bool = False) -> list[ModelStatus]:
        return (await self.repository("index", ready_only=ready_only)).index or []

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        return (await self.repository("statistics", name, version=version)).statistics or []

    async def shadow_report(self, champion: str) -> ShadowReport:
        report = (await self.repository("shadow", champion)).shadow
        assert report is not None
        return report

    async def load_model(self, name: str) -> None:
        await self.repository("load", name)

    async def unload_model(self, name: str) -> None:
        await self.repository("unload", name)

    async def keep_head(self, name: str, version: str, embedded: Embedded) -> Mapping[str, Any]:
        head = (await self.repository("teach", name, version=version, embedded=embedded)).head
        assert head is not None
        return head

    async def delete_head(self, name: str, head: str) -> None:
        await self.repository("delete-head", name, head=head)
