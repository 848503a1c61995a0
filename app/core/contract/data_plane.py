"""The data plane: everything an edge may ask of the serving core, and nothing more.

Every edge (`/predict` and V2 over HTTP, V2 over gRPC, the batch runner, the Ray job) holds a
`DataPlane` and calls only it: health, model descriptions, `infer`, the model repository and
`authorize`. The edges type against this protocol, so none can tell whether the implementation
lives in its own process (`app.core.engine.engine.Engine`) or reaches an engine in another one. The
synchronous members answer from state the data plane holds where the edge runs; whatever may wait
on the engine is a coroutine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport
from app.core.contract.regions import SharedMemoryRegions
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions, Prediction
from app.telemetry.metrics import Metrics
from app.telemetry.statistics import ModelStatistics

T = TypeVar("T")


@dataclass(frozen=True)
class InferenceRequest:
    """One request for the core: which model, the images (files as sent, or decoded by a front-end) or pixels
    (N, C, H, W), the options."""

    model: str | None  # None: the default model (the first one loaded)
    inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor
    options: InferOptions
    version: str | None = None  # None: whichever version serves
    timeout_s: float | None = None  # shortens VIT_REQUEST_TIMEOUT_S (a gRPC client's deadline)
    # texts to embed, for a zero-shot model: a request of its own, with no images (`inputs` empty)
    texts: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Inference:
    """One request's answer: the model version that computed it, and a prediction per image in input order."""

    model: ModelDescription
    predictions: list[Prediction]
    labels: tuple[str, ...] | None = None  # a zero-shot model's labels the request named
    text_embeddings: torch.Tensor | None = None  # (T, D), unit length: a zero-shot model's embeddings of the texts

    @property
    def classes(self) -> list[str]:
        """What each probability is of, in order: the labels named, else the model's classes."""
        return self.model.classes_for(self.labels)


# Past this many values a response is encoded on the pool: below it, the hop to a thread costs about as much
# as the encoding.
INLINE_ENCODE_MAX_VALUES = 1000


def costly_to_encode(done: Inference) -> bool:
    """Whether an edge's encoding of `done` is worth a hop off the event loop: many values, or attention maps."""
    values = sum(
        p.probabilities.numel() + (0 if p.embedding is None else p.embedding.numel()) for p in done.predictions
    )
    return values > INLINE_ENCODE_MAX_VALUES or any(p.attention_map is not None for p in done.predictions)


@dataclass(frozen=True)
class Limits:
    """What an edge checks before handing a request over."""

    max_upload_bytes: int  # largest request body
    max_files: int  # most images in one request
    takes_pixels: bool = True  # whether V2 takes preprocessed pixels (the input `pixels`) as well as image files
    all_outputs: bool = True  # whether V2 lists (and answers) every output, or probabilities alone


@dataclass(frozen=True)
class Batching:
    """How every model's images are queued and batched (the settings served with), for the edges to describe."""

    max_batch_size: int  # images in one forward pass
    max_wait_ms: float  # longest wait after a batch's first image for more
    max_queue: int  # images waiting before requests are refused
    request_timeout_s: float  # a request's images not computed by then are dropped
    response_cache: bool


class DataPlane(Protocol):
    """What every edge calls. Errors are `app.core.contract.errors.ServiceError`s, which each edge maps to its protocol."""

    limits: Limits
    batching: Batching
    metrics: Metrics
    regions: SharedMemoryRegions  # the system shared-memory regions clients registered

    def live(self) -> bool:
        """True while the process serves."""
        ...

    def ready(self) -> bool:
        """What readiness probes are told: True once every model is loaded and warm; False before that and from
        the start of shutdown."""
        ...

    def check_serving(self) -> None:
        """NotReady unless requests are taken: from startup until the engine stops. While the process drains,
        `ready()` is False but requests still are: the edges take no new connections or calls then, so what
        reaches the data plane was accepted before the shutdown began and is answered."""
        ...

    def authorize(self, credentials: str | None) -> None:
        """Unauthorized unless `credentials` is a valid API key (anything passes when VIT_API_KEYS is unset)."""
        ...

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether that model (at that version) is serving."""
        ...

    def describe(self, name: str | None, version: str | None = None) -> ModelDescription:
        """The model called `name` (None: the default one); ModelNotFound when none serves (at `version`)."""
        ...

    def models(self) -> list[ModelDescription]:
        """Every model serving now, the default first."""
        ...

    async def infer(self, request: InferenceRequest, encode: Callable[[Inference], T]) -> T:
        """The request's predictions, encoded by the edge's `encode` (run off the event loop when costly)."""
        ...

    async def repository_index(self, ready_only: bool = False) -> list[ModelStatus]:
        """Every model known here or held by the repository, by name."""
        ...

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        """Triton's statistics (app.telemetry.statistics) of every model version that has served (no name), of one
        model's versions, or of one version; ModelNotFound when none has served under that name (and version)."""
        ...

    async def shadow_report(self, champion: str) -> ShadowReport:
        """How the champion's shadow challenger (VIT_SHADOW) compares with it so far; ModelNotFound without one."""
        ...

    async def load_model(self, name: str) -> None:
        """Load (or reload) a model from the repository."""
        ...

    async def unload_model(self, name: str) -> None:
        """Stop admitting requests for a model, answer those admitted, then free it."""
        ...
