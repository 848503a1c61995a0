"""A data plane that is not the engine: what an edge sees of a core it cannot reach into."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from app.core.contract.data_plane import Inference, InferenceRequest, Limits
from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport
from app.core.contract.errors import NotReady
from app.telemetry.metrics import Metrics
from app.telemetry.statistics import ModelStatistics

T = TypeVar("T")


class UnreadyDataPlane:
    """A `DataPlane` whose models never finish loading: live, never ready, every call answered NotReady."""

    def __init__(self) -> None:
        self.limits = Limits(max_upload_bytes=1024, max_files=1)
        self.metrics = Metrics()
        self.calls: list[str] = []

    def refuse(self, call: str) -> NotReady:
        self.calls.append(call)
        return NotReady("not ready: the models are not loaded yet")

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return False

    def check_serving(self) -> None:
        raise self.refuse("check_serving")

    def authorize(self, credentials: str | None) -> None:
        raise self.refuse("authorize")

    def model_ready(self, name: str, version: str | None = None) -> bool:
        self.calls.append("model_ready")
        return False

    def describe(self, name: str | None, version: str | None = None) -> ModelDescription:
        raise self.refuse("describe")

    def models(self) -> list[ModelDescription]:
        raise self.refuse("models")

    async def infer(self, request: InferenceRequest, encode: Callable[[Inference], T]) -> T:
        raise self.refuse("infer")

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
