"""The data plane while the models load: what the edges serve from the moment they listen until the engine is
ready, so that a probe or a client meets an answer (503 `not ready`, gRPC UNAVAILABLE) and never a refused
connection.

    serving = Serving(LoadingPlane(settings, metrics), settings, http=(host, port))
    await serving.start()                 # listening: /health/live 200, /health/ready 503
    engine = await asyncio.to_thread(Engine.load, settings, metrics)
    serving.hand_over(engine)             # every edge serves the engine from its next request on
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport
from app.core.contract.errors import LOADING, NotReady
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.teaching import Embedded
from app.core.data_plane import DataPlane
from app.settings import Settings
from app.telemetry.metrics import Metrics
from app.telemetry.statistics import ModelStatistics


class LoadingPlane(DataPlane):
    """Live, never ready, no model yet: every call that needs one answered NotReady (LOADING)."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        super().__init__(settings, metrics, cpu_threads=1)

    def ready(self) -> bool:
        return False

    def check_taking(self) -> None:
        raise NotReady(LOADING)

    def models(self) -> list[ModelDescription]:
        return []

    async def compute(self, request: InferenceRequest) -> Inference:
        raise NotReady(LOADING)

    async def repository_index(self, ready_only: bool = False) -> list[ModelStatus]:
        raise NotReady(LOADING)

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        raise NotReady(LOADING)

    async def shadow_report(self, champion: str) -> ShadowReport:
        raise NotReady(LOADING)

    async def load_model(self, name: str) -> None:
        raise NotReady(LOADING)

    async def unload_model(self, name: str) -> None:
        raise NotReady(LOADING)

    async def keep_head(self, name: str, version: str, embedded: Embedded) -> Mapping[str, Any]:
        raise NotReady(LOADING)

    async def delete_head(self, name: str, head: str) -> None:
        raise NotReady(LOADING)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        self.cpu_pool.shutdown(wait=False)
        self.regions.close()
