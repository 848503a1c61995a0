"""The data plane: everything an edge may ask of the serving core, and nothing more, written once over a
compute step that runs here or in another process.

Every edge (`/predict` and V2 over HTTP, V2 over gRPC, the batch runner, the Ray job) holds a `DataPlane` and
calls only it: health, the limits it checks, API keys, model descriptions (with the one error text a client
sees), `infer`, and the model repository. What computes a request is the subclass's:
`app.core.engine.engine.Engine` runs it on the models in this process; `app.workers.engine_client.EngineClient`
decodes the images here and has the engine process compute them (VIT_WORKERS > 1). No edge can tell which it
holds. The synchronous members answer from state held where the edge runs; whatever may wait on the engine is
a coroutine. Errors are `app.core.contract.errors.ServiceError`s, which each edge maps to its protocol.

Draining: each edge holds each request it serves in `accepted()`, from its arrival to its answer. From
`begin_drain()` on, readiness is off and a request that arrives is refused (`Draining`), while those accepted
before are answered; `settle()` waits for them, and `cut()` answers those still running when the drain time is
out with `Draining` (the edge's `accepted()` turns the cancellation into that answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import torch

from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport, canonical_version
from app.core.contract.errors import (
    DRAIN_TIMED_OUT,
    DRAINING,
    Draining,
    InvalidInput,
    ModelNotFound,
    NotAllowed,
    PayloadTooLarge,
    Unauthorized,
    UnsupportedMediaType,
)
from app.core.contract.inference import Batching, Inference, InferenceRequest, Limits, costly_to_encode
from app.core.contract.regions import SharedMemoryRegions
from app.core.contract.request import EncodedImage, InferOptions
from app.core.contract.teaching import Embedded, Lesson, check_teaching, examples_in_folder
from app.settings import Settings
from app.telemetry.metrics import Metrics
from app.telemetry.spans import child_span
from app.telemetry.statistics import ModelStatistics

T = TypeVar("T")
TEACH_CHUNK = 8  # a lesson's images in one request of the model's: a few places in each batch, not all of them
# Whether the request being served arrived before the drain began (set by `DataPlane.accepted`).
ARRIVED_BEFORE_DRAIN: ContextVar[bool] = ContextVar("arrived_before_drain", default=False)


class ApiKeys:
    """VIT_API_KEYS: checked the same way whichever edge a request came through."""

    def __init__(self, keys: frozenset[str]) -> None:
        self.keys = keys

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def check(self, given: str) -> None:
        """Raise Unauthorized unless keys are off or `given` is one of them."""
        if not self.keys:
            return
        # compare with every key, in constant time, so timing reveals neither key nor position
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(given.encode(), key.encode())
        if not matched:
            raise Unauthorized("missing or invalid API key")  # each edge says how its protocol carries one


def find_model(served: list[ModelDescription], name: str | None, version: str | None = None) -> ModelDescription:
    """The model called `name` among `served` (the first for None), at `version` when one is given."""
    model = served[0] if name is None and served else next((m for m in served if m.name == name), None)
    if model is None:
        asked = "no model is loaded" if name is None else f"no model named {name!r}"
        raise ModelNotFound(f"{asked}; this service serves: {served_names(served)}")
    if version is not None and canonical_version(version) != model.version:
        raise ModelNotFound(f"model {name!r} has no version {version!r}; it serves version {model.version}")
    return model


def served_names(served: list[ModelDescription]) -> str:
    return ", ".join(m.name for m in served) or "no model (load one through the model repository API)"


class DataPlane(ABC):
    """What every edge calls: the edges' side written here, the compute step left to the subclass."""

    def __init__(self, settings: Settings, metrics: Metrics, cpu_threads: int, regions: Path | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.limits = Limits(
            settings.max_upload_bytes, settings.max_files, settings.v2_pixels, settings.v2_outputs == "all"
        )
        s = settings
        self.batching = Batching(s.max_batch_size, s.max_wait_ms, s.max_queue, s.request_timeout_s, s.cache_bytes > 0)
        self.api_keys = ApiKeys(settings.api_key_set())
        # the system shared-memory regions clients register: in `regions`, shared with the other front-ends
        self.regions = SharedMemoryRegions(regions, settings.shared_memory_regions)
        # decoding, overlays and large responses: CPU work kept off the event loop
        self.cpu_pool = ThreadPoolExecutor(max_workers=min(cpu_threads, os.cpu_count() or 1), thread_name_prefix="cpu")
        self.draining = False  # from begin_drain() on
        self.running: set[asyncio.Task[object]] = set()  # the tasks serving accepted requests
        self.all_answered = asyncio.Event()
        self.all_answered.set()
        self.cut_tasks: set[asyncio.Task[object]] = set()  # those still running when the drain ran out

    # The compute step's.
    @abstractmethod
    def models(self) -> list[ModelDescription]:
        """Every model serving now, the default first."""

    @abstractmethod
    def ready(self) -> bool:
        """What readiness probes are told: True once every model is loaded and warm; False before that and from
        the start of shutdown."""

    @abstractmethod
    def check_taking(self) -> None:
        """NotReady unless the compute step takes requests: once the models are loaded, until it stops."""

    @abstractmethod
    async def compute(self, request: InferenceRequest) -> Inference:
        """`request`'s predictions, overlays drawn where asked."""

    @abstractmethod
    async def repository_index(self, ready_only: bool = False) -> list[ModelStatus]:
        """Every model known here or held by the repository, by name."""

    @abstractmethod
    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        """Triton's statistics (app.telemetry.statistics) of every model version that has served (no name), of one
        model's versions, or of one version; ModelNotFound when none has served under that name (and version)."""

    @abstractmethod
    async def shadow_report(self, champion: str) -> ShadowReport:
        """How the champion's shadow challenger (VIT_SHADOW) compares with it so far; ModelNotFound without one."""

    @abstractmethod
    async def load_model(self, name: str) -> None:
        """Load (or reload) a model from the repository."""

    @abstractmethod
    async def unload_model(self, name: str) -> None:
        """Stop admitting requests for a model, answer those admitted, then free it."""

    @abstractmethod
    async def keep_head(self, name: str, version: str, embedded: Embedded) -> Mapping[str, Any]:
        """A head fitted on `embedded` (examples embedded by version `version` of model `name`), kept in the model's
        heads folder and answering from the next request on, at every edge: what a listing says of it."""

    @abstractmethod
    async def delete_head(self, name: str, head: str) -> None:
        """Model `name`'s head `head` deleted, at every edge."""

    @abstractmethod
    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Answer what was accepted (within `timeout_s`, default VIT_DRAIN_TIMEOUT_S), then stop."""

    # The edges' side.
    def live(self) -> bool:
        """True while the process serves."""
        return True

    def check_serving(self) -> None:
        """NotReady unless requests are taken: not while the models load, nor once the compute step stopped; while
        the process drains, Draining for a request that arrived after the drain began."""
        if self.draining and not ARRIVED_BEFORE_DRAIN.get():
            raise Draining(DRAINING)
        self.check_taking()

    def begin_drain(self) -> None:
        """Unready for every protocol at once, and requests arriving from now on refused (Draining): the first step
        of shutdown. The requests accepted before are still served."""
        self.draining = True

    @contextlib.contextmanager
    def accepted(self) -> Iterator[None]:
        """Around an edge's request, from its arrival to its answer: counted until answered (what `settle` waits
        for), refused by `check_serving` if it arrived while draining. A `Draining` raised inside, or the
        cancellation `cut` sends, is the edge's to answer as its protocol says."""
        task = asyncio.current_task()
        token = ARRIVED_BEFORE_DRAIN.set(not self.draining)
        if task is not None:
            self.running.add(task)
            self.all_answered.clear()
        try:
            yield
        finally:
            ARRIVED_BEFORE_DRAIN.reset(token)
            if task is not None:
                self.running.discard(task)
                if not self.running:
                    self.all_answered.set()

    async def settle(self, timeout_s: float) -> bool:
        """Whether every accepted request was answered within `timeout_s`."""
        try:
            await asyncio.wait_for(self.all_answered.wait(), max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False

    def cut(self) -> int:
        """The drain time is out: each request still running is cancelled, and its edge answers it Draining
        (DRAIN_TIMED_OUT); how many there were."""
        cut = [task for task in self.running if not task.done()]
        self.cut_tasks.update(cut)
        for task in cut:
            task.cancel()
        return len(cut)

    def cut_here(self) -> bool:
        """Whether the current task was cancelled by `cut`: its edge answers it Draining (DRAIN_TIMED_OUT), and the
        task is no longer cancelled."""
        task = asyncio.current_task()
        if task is None or task not in self.cut_tasks:
            return False
        task.uncancel()
        return True

    @staticmethod
    def cut_error() -> Draining:
        return Draining(DRAIN_TIMED_OUT)

    def authorize(self, credentials: str | None) -> None:
        """Unauthorized unless `credentials` is a valid API key (anything passes when VIT_API_KEYS is unset)."""
        self.api_keys.check(credentials or "")

    def describe(self, name: str | None, version: str | None = None) -> ModelDescription:
        """The model called `name` (None: the default one); ModelNotFound when none serves (at `version`)."""
        return find_model(self.models(), name, version)

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether that model (at that version) is serving."""
        asked = canonical_version(version) if version else None
        return self.ready() and any(m.name == name and asked in (None, m.version) for m in self.models())

    async def infer(self, request: InferenceRequest, encode: Callable[[Inference], T]) -> T:
        """The request's predictions, encoded by the edge's `encode` (run off the event loop when costly)."""
        self.check_serving()
        done = await self.compute(request)
        with child_span("encode"):
            return await self.run_in_pool(encode, done) if costly_to_encode(done) else encode(done)

    def check_teaching(self) -> None:
        """NotAllowed where teaching heads over the API is off (VIT_TEACH_MAX_EXAMPLES=0)."""
        check_teaching(self.settings.teach_max_examples)

    def examples_in(self, folder: str) -> dict[str, list[EncodedImage]]:
        """The example images of a folder of the model repository, by class (`folder/<class>/*.jpg`); blocking."""
        self.check_teaching()
        if self.settings.model_repository is None:
            raise NotAllowed(
                "folder= names a folder of the model repository (VIT_MODEL_REPOSITORY), and this server has none: "
                "send the images in the body"
            )
        return examples_in_folder(self.settings.model_repository, folder)

    async def teach(self, name: str | None, lesson: Lesson) -> Mapping[str, Any]:
        """A head taught on model `name` (None: the default one) from `lesson`'s images: embedded on the model's own
        batches, TEACH_CHUNK images at a time (traffic's requests take their places in the batches between), then
        fitted and kept by the compute step. What a listing says of it."""
        self.check_serving()
        model = self.describe(name)
        lesson.check_against(model.name, model.heads, self.settings.teach_max_examples)
        options = InferOptions(embedding=True, classify=False)  # a zero-shot model's image in the joint space
        embeddings: list[torch.Tensor] = []
        for cls, images in lesson.examples.items():
            for start in range(0, len(images), TEACH_CHUNK):
                chunk = images[start : start + TEACH_CHUNK]
                request = InferenceRequest(model, chunk, options, version=model.version)
                try:
                    done = await self.compute(request)
                except (InvalidInput, UnsupportedMediaType, PayloadTooLarge) as e:
                    raise type(e)(f"class {cls!r}: {e.detail}") from None
                embeddings += [p.embedding for p in done.predictions if p.embedding is not None]
        return await self.keep_head(model.name, model.version, Embedded.of(lesson, embeddings))

    async def run_in_pool(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the CPU pool, so the event loop only parses, awaits and writes."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)
