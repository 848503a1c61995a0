"""Prometheus metrics of one service instance (its own registry, so several apps can coexist in tests).

With several serving processes (VIT_WORKERS > 1) every process writes its series to files in
PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode, set up by `python -m app` before it
starts them), and `/metrics` from any front-end renders the sum over all of them: one view of the service.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from app.telemetry.statistics import BatchTiming, ModelStatistics, StatisticsBook

LOAD_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "vit_requests",
            "Requests by protocol (http, grpc), route (or RPC) and status (HTTP status or gRPC code)",
            ["protocol", "route", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "vit_requests_in_flight",
            "Requests accepted and not yet answered, by protocol and route (or RPC)",
            ["protocol", "route"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.latency = Histogram(
            "vit_request_latency_seconds",
            "Request latency by protocol and route (or RPC)",
            ["protocol", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "vit_batch_size", "Images per forward pass", ["model"], buckets=BATCH_BUCKETS, registry=r
        )
        self.inference = Histogram(
            "vit_inference_seconds", "Time of one batch's forward pass", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue = Gauge(
            "vit_queue_depth", "Images waiting for a batch", ["model"], registry=r, multiprocess_mode="livesum"
        )
        self.cpu_decode_share = Gauge(
            "vit_cpu_decode_share",
            "Share of a GPU model's plain JPEGs decoded on the host's cores, the rest on the GPU (VIT_CPU_DECODE_SHARE: "
            "fixed, or moved by what the batches measure with auto)",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.preferred_batch_size = Gauge(
            "vit_preferred_batch_size",
            "Images the batcher fills a batch to (VIT_PREFERRED_BATCH_SIZE: fixed, or with auto on the CPU the size "
            "timed at warm-up to serve the most images a second)",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.images = Counter("vit_images_processed", "Images computed by the model", ["model"], registry=r)
        self.dropped_images = Counter(
            "vit_images_dropped",
            "Images dropped before computing (cancelled: client gone; expired: deadline)",
            ["model", "reason"],
            registry=r,
        )
        self.ready = Gauge(
            "vit_ready", "1 when every model is loaded and warm", registry=r, multiprocess_mode="livemax"
        )
        self.models_loaded = Gauge("vit_models_loaded", "Models serving now", registry=r, multiprocess_mode="livemax")
        self.model_load_seconds = Histogram(
            "vit_model_load_seconds", "Time to load and warm one model version", buckets=LOAD_BUCKETS, registry=r
        )
        self.model_load_failures = Counter(
            "vit_model_load_failures", "Model versions that failed to load, by model", ["model"], registry=r
        )
        self.cache_hits = Counter(
            "vit_cache_hits",
            "Images answered from the response cache (or its computation under way)",
            ["model"],
            registry=r,
        )
        self.cache_misses = Counter("vit_cache_misses", "Images the response cache did not hold", ["model"], registry=r)
        self.text_embeddings = Counter(
            "vit_text_embeddings",
            "Label prompts a zero-shot model's text tower embedded (each then kept: VIT_TEXT_CACHE_LABELS)",
            ["model"],
            registry=r,
        )
        self.cache_bytes = Gauge(
            "vit_cache_bytes", "Bytes the response cache holds", registry=r, multiprocess_mode="livesum"
        )
        self.drift = Gauge(
            "vit_drift_score",
            "Drift of the last VIT_DRIFT_WINDOW images from the model's reference data: kind=prediction, the total "
            "variation distance of the predicted classes from the reference prior (0 to 1); kind=embedding, their "
            "mean out-of-distribution score",
            ["model", "kind"],
            registry=r,
            multiprocess_mode="livemax",
        )
        pair = ["champion", "challenger"]
        self.shadow_compared = Counter(
            "vit_shadow_compared", "Images both the champion and its shadow challenger computed", pair, registry=r
        )
        self.shadow_agreed = Counter(
            "vit_shadow_top1_agreements", "Shadow-compared images with the same top-1 class", pair, registry=r
        )
        self.shadow_tv_distance = Counter(
            "vit_shadow_tv_distance",
            "Sum over shadow-compared images of the total variation distance between the two probability vectors",
            pair,
            registry=r,
        )
        self.shadow_shed = Counter(
            "vit_shadow_shed", "Images picked for the shadow challenger but shed (load, or a failure)", pair, registry=r
        )
        self.gc_pause = Histogram(
            "vit_gc_pause_seconds",
            "Garbage collections (every thread waits meanwhile), by generation",
            ["generation"],
            buckets=GC_BUCKETS,
            registry=r,
        )
        self._gc_started = 0.0

    def watch_gc(self) -> None:
        """Time every garbage collection of the process from now on (until `unwatch_gc`)."""
        gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_pause.labels(str(info["generation"])).observe(time.perf_counter() - self._gc_started)

    def render(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # every serving process's series, summed
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


DROP_REASONS = ("cancelled", "expired")  # why images are dropped before computing (vit_images_dropped_total)


class ModelMetrics:
    """One model's view of the metrics: its batcher's observer, every series labelled with its name, and
    the statistics of its version (bound once the checkpoint is read)."""

    def __init__(self, metrics: Metrics, model: str, book: StatisticsBook | None = None) -> None:
        self.metrics = metrics
        self.model = model
        self.book = book
        self.statistics: ModelStatistics | None = None
        for series in (
            metrics.batch_size,
            metrics.inference,
            metrics.images,
            metrics.cache_hits,
            metrics.cache_misses,
            metrics.model_load_failures,
        ):
            series.labels(model)  # every series exists from the start, at zero
        for reason in DROP_REASONS:
            metrics.dropped_images.labels(model, reason)
        # the series each batch touches, looked up once (a lookup takes a lock and builds a key)
        self.batch_size = metrics.batch_size.labels(model)
        self.inference = metrics.inference.labels(model)
        self.images = metrics.images.labels(model)
        self.queue = metrics.queue.labels(model)
        self.queue.set(0)
        self.text_embeddings = metrics.text_embeddings.labels(model)
        self.cpu_decode_share = metrics.cpu_decode_share.labels(model)
        self.preferred_batch_size = metrics.preferred_batch_size.labels(model)

    def drift_gauges(self) -> tuple[Any, Any]:
        """This model's two drift gauges (`vit_drift_score`), prediction and embedding."""
        return self.metrics.drift.labels(self.model, "prediction"), self.metrics.drift.labels(self.model, "embedding")

    def bind_version(self, version: str) -> None:
        if self.book is not None:
            self.statistics = self.book.of(self.model, version)

    # BatchObserver
    def batch_done(self, size: int, seconds: float, outputs: Sequence[object] = ()) -> None:
        self.batch_size.observe(size)
        self.inference.observe(seconds)
        self.images.inc(size)
        timing = getattr(outputs[0], "batch", None) if outputs else None
        if self.statistics is not None and isinstance(timing, BatchTiming):
            self.statistics.batch_done(size, timing.input_s, timing.infer_s, timing.output_s)
        elif self.statistics is not None:  # outputs that carry no timing (a stand-in predictor)
            self.statistics.batch_done(size, 0.0, seconds, 0.0)

    def dropped(self, reason: str, count: int) -> None:
        self.metrics.dropped_images.labels(self.model, reason).inc(count)

    def queue_depth(self, depth: int) -> None:
        self.queue.set(depth)
