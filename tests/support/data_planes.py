"""A data plane that is not the engine: what an edge sees of a core it cannot reach into."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport
from app.core.contract.errors import NotReady
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.teaching import Embedded
from app.core.data_plane import DataPlane
from app.settings import Settings
from app.telemetry.metrics import Metrics
from app.telemetry.statistics import ModelStatistics


class UnreadyDataPlane(DataPlane):
    """A `DataPlane` whose models never finish loading: live, never ready, every call answered NotReady."""

    def __init__(self) -> None:
        super().__init__(Settings(max_upload_bytes=1024, max_files=1), Metrics(), cpu_threads=1)
        self.calls: list[str] = []

    def refuse(self, call: str) -> NotReady:
        self.calls.append(call)
        return NotReady("not ready: the models are not loaded yet")

    def ready(self) -> bool:
        return False

    def check_taking(self) -> None:
        raise self.refuse("check_taking")

    def models(self) -> list[ModelDescription]:
        raise self.refuse("models")

    async def compute(self, request: InferenceRequest) -> Inference:
        raise self.refuse("compute")

    async def repository_index(self, ready_only: bool = False) -> list[ModelStatus]:
        raise self.refuse("repository_index")

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        raise self.refuse("statistics")

    async def shadow_report(self, champion: str) -> ShadowReport:
        raise self.refuse("shadow_report")

    async def load_model(self, name: str) -> None:
        raise self.refuse("load_model")

    async def unload_model(self, name: str) -> None:
        raise self.refuse("unload_model")

    async def keep_head(self, name: str, version: str, embedded: Embedded) -> Mapping[str, Any]:
        raise self.refuse("keep_head")

    async def delete_head(self, name: str, head: str) -> None:
        raise self.refuse("delete_head")

    def begin_drain(self) -> None:
        super().begin_drain()
        self.calls.append("begin_drain")

    async def shutdown(self, timeout_s: float | None = None) -> None:
        self.cpu_pool.shutdown(wait=False)
