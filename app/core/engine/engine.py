"""The engine: the data plane whose compute step runs in this process, owning every served model,
readiness and shutdown.

`Engine.load` builds it whole (models loaded and warm); `start` runs it on the event loop, `shutdown`
answers what it admitted and stops; `Engine.serving` does all three around a block. Edges reach it only
through the `DataPlane` members (written once in `app.core.data_plane`); the rest (`model`, `lane`, `served`,
`model_set`) is the core's own. Every request takes one path through it, as a `Call`: its `lane`
(`app.core.engine.lane`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch

from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport, canonical_version
from app.core.contract.errors import NOT_READY, ModelNotFound, NotReady
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.teaching import Embedded
from app.core.data_plane import DataPlane
from app.core.engine.cache import PredictionCache
from app.core.engine.lane import Lane
from app.core.engine.model_set import ModelSet
from app.core.engine.repository import Repository
from app.core.engine.served_model import ServedModel
from app.core.engine.shadow_traffic import ShadowTraffic
from app.core.engine.startup_checks import check_shadows, check_thresholds, startup_models
from app.settings import HubName, Settings
from app.telemetry.metrics import Metrics, ModelMetrics
from app.telemetry.statistics import ModelStatistics, StatisticsBook
from model.device import cuda_unavailable_reason, resolve_device

log = logging.getLogger("app")


class Engine(DataPlane):
    """A `DataPlane` whose compute step runs in this process, on the models it owns."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        models: ModelSet,
        statistics: StatisticsBook | None = None,
        scratch: list[Path] | None = None,
    ) -> None:
        super().__init__(settings, metrics, cpu_threads=8)
        self.scratch = scratch or []  # folders of hub models converted for this engine alone: removed as it stops
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
        self.lane = Lane(settings, models, self.book, self.cache, self.shadowing, self.cpu_pool)

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

        repository = Repository(settings.model_repository) if settings.model_repository else None
        files = repository.scan() if repository else {}
        paths = startup_models(settings, repository, files)
        # with no VIT_HUB_CACHE to keep them, hub models are converted into folders of the engine's own
        named = settings.model_paths() if repository is None and settings.hub_cache is None else {}
        scratch = [paths[name].parent for name, given in named.items() if isinstance(given, HubName)]

        def build(name: str, path: Path) -> ServedModel:
            metered = ModelMetrics(metrics, name, statistics)
            return ServedModel.load(name, path, settings, device, metered, scratch=path.parent in scratch)

        try:
            served = {}
            for name, path in paths.items():
                started = time.perf_counter()
                served[name] = build(name, path)
                metrics.model_load_seconds.observe(time.perf_counter() - started)
            s = settings
            models = ModelSet(served, build, repository, s.model_control, metrics, s.drain_timeout_s, files)
            return cls(s, metrics, models, statistics, scratch)
        except BaseException:
            remove(scratch)
            raise

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

    # The DataPlane's compute step.
    def models(self) -> list[ModelDescription]:
        return [m.description for m in self.served.values()]

    def ready(self) -> bool:
        return self.is_ready

    def check_taking(self) -> None:
        if not self.taking_requests:
            raise NotReady(NOT_READY)

    async def compute(self, request: InferenceRequest) -> Inference:
        served = self.model(request.model.name, request.version)  # unloaded since the edge looked it up: not found
        return await self.lane.run(served, request.inputs, request.options, request.timeout_s, request.texts)

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

    async def shadow_report(self, champion: str) -> ShadowReport:
        return self.shadowing.report(champion)

    async def keep_head(self, name: str, version: str, embedded: Embedded) -> Mapping[str, Any]:
        return (await self.model_set.teach(name, version, embedded)).describe()

    async def delete_head(self, name: str, head: str) -> None:
        await self.model_set.forget_head(name, head)

    def begin_drain(self) -> None:
        super().begin_drain()
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
                log.warning(
                    "model %s: %d images not computed within VIT_DRAIN_TIMEOUT_S (%.0f s left of it)",
                    model.name,
                    queued,
                    timeout,
                )
            await model.batcher.stop()
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)
        self.regions.close()
        remove(self.scratch)
        if self.started:
            self.metrics.unwatch_gc()
        if self.froze_heap:
            gc.unfreeze()  # back to the collector: the program may go on (the batch runner's caller, a test)


def remove(folders: list[Path]) -> None:
    """Folders and what they hold, gone (those already gone too)."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
