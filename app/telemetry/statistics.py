"""Per model version statistics, as Triton's statistics extension reports them (GET /v2/models/stats, gRPC
ModelStatistics), in terms of this service's pipeline.

A request here is one call of the core for one model: the images of a `/predict` or V2 request, or of one
batch-runner chunk. Per request:

- `success` / `fail`: requests answered or failed after their model was found, and their time in the core
  (decoding, the wait for a batch, the forward pass, the outputs);
- `queue`: from the request's images entering the batcher until the batch that computes the last of them
  starts;
- `compute_input`: decoding and preprocessing on the CPU (and the wait for a CPU thread to do it), then
  the input stage of its batch: pixels copied to the device, or JPEGs decoded on the GPU;
- `compute_infer`: its batch's forward pass, with the probabilities (and maps, embeddings) copied back
  to the CPU;
- `compute_output`: its outputs made into predictions: embeddings normalised, overlays drawn;
- `cache_hit` / `cache_miss` (VIT_CACHE_BYTES): images found in the response cache or not, and the time
  spent hashing and looking them up.

Per batch (`batch_stats`, by batch size): `compute_input`, `compute_infer` and `compute_output` (splitting
the batch's outputs by image) of each forward pass. `inference_count` counts images answered (computed
or from the cache), `execution_count` forward passes. Times are in nanoseconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchTiming:
    """Where one forward pass's time went, in seconds; `started` on time.monotonic()'s clock."""

    size: int
    started: float
    input_s: float  # pixels copied to the device, JPEGs decoded on the GPU
    infer_s: float  # the forward pass, outputs copied back to the CPU
    output_s: float  # the outputs split by image


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        if seconds > 0:  # (a clock's step backwards adds nothing)
            self.ns += int(seconds * 1e9 + 0.5)


@dataclass
class BatchStatistics:
    batch_size: int
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ModelStatistics:
    """One model version's statistics since the service started."""

    name: str
    version: str
    last_inference_ms: int = 0  # milliseconds since the epoch of the last request answered
    inference_count: int = 0
    execution_count: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStatistics] = field(default_factory=dict)

    def batch_done(self, size: int, input_s: float, infer_s: float, output_s: float) -> None:
        self.execution_count += 1
        stats = self.batches.get(size)
        if stats is None:
            stats = self.batches[size] = BatchStatistics(size)
        stats.compute_input.add(input_s)
        stats.compute_infer.add(infer_s)
        stats.compute_output.add(output_s)

    def answered(self, images: int, seconds: float, requests: int = 1) -> None:
        self.success.add(seconds, requests)
        self.inference_count += images
        self.last_inference_ms = time.time_ns() // 1_000_000

    def computed(self, images: int, seconds: float, timing: RequestTiming, requests: int = 1) -> None:
        """`requests` (one, or several answered together) answered by computing their `images` in `seconds`
        (summed over them), their time spent as `timing` (summed) says."""
        self.answered(images, seconds, requests)
        self.queue.add(timing.queue, requests)
        self.compute_input.add(timing.compute_input, requests)
        self.compute_infer.add(timing.compute_infer, requests)
        self.compute_output.add(timing.compute_output, requests)


@dataclass
class RequestTiming:
    """Where one request's time went, in seconds (see the module note)."""

    queue: float
    compute_input: float
    compute_infer: float
    compute_output: float


class StatisticsBook:
    """Every model version's statistics since startup, by (name, version)."""

    def __init__(self) -> None:
        self.models: dict[tuple[str, str], ModelStatistics] = {}

    def of(self, name: str, version: str) -> ModelStatistics:
        stats = self.models.get((name, version))
        if stats is None:
            stats = self.models[(name, version)] = ModelStatistics(name, version)
        return stats

    def select(self, name: str | None, version: str | None) -> list[ModelStatistics]:
        """All versions of all models (no name), of one model (no version), or one version, by name."""
        return sorted(
            (s for s in self.models.values() if name in (None, s.name) and version in (None, s.version)),
            key=lambda s: (s.name, s.version),
        )
