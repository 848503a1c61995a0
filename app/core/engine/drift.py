"""Drift of a model's live traffic from its reference data, over a sliding window of the last images it computed.

Two gauges per model (Prometheus `vit_drift_score{model, kind}`), for a checkpoint with reference statistics:
- `prediction`: the total variation distance between the window's predicted classes and the reference's class
  prior, from 0 (the same mix of classes as the reference data) to 1 (none of the classes it had);
- `embedding`: the window's mean out-of-distribution score (the Mahalanobis distance of each image's embedding
  to the nearest class mean, or 1 - its top probability, as the statistics say; model/reference/), in the same
  units as `ood_score`.

The window is fed a batch at a time (`Watching`, the batcher's observer): every image the version computed,
whoever asked and whether or not they asked for scores, scored once per batch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from app.core.backends.predictor import ImageOutput
from app.core.batching.batcher import BatchObserver
from model.reference import Reference

log = logging.getLogger("app")


class Settable(Protocol):
    def set(self, value: float) -> None: ...


class DriftWindow:
    """The last `size` images of one model version: predicted classes and out-of-distribution scores."""

    def __init__(self, size: int, prior: torch.Tensor) -> None:
        self.size = size
        self.prior = prior.double().numpy()
        self.classes: deque[int] = deque()
        self.scores: deque[float] = deque()
        self.counts = np.zeros(len(self.prior))
        self.score_sum = 0.0
        self.added = 0  # since the score sum was last summed afresh

    def __len__(self) -> int:
        return len(self.classes)

    def add(self, classes: list[int], scores: list[float]) -> None:
        for c, s in zip(classes, scores, strict=True):
            if len(self.classes) == self.size:
                self.counts[self.classes.popleft()] -= 1
                self.score_sum -= self.scores.popleft()
            self.classes.append(c)
            self.scores.append(s)
            self.counts[c] += 1
            self.score_sum += s
        self.added += len(classes)
        if self.added >= self.size:  # rounding of a running sum that also subtracts stays bounded
            self.score_sum, self.added = float(np.sum(self.scores)), 0

    def prediction_drift(self) -> float:
        """Total variation distance between the window's predicted-class shares and the reference prior."""
        n = len(self.classes)
        return 0.5 * float(np.abs(self.counts / n - self.prior).sum()) if n else 0.0

    def embedding_drift(self) -> float:
        """The window's mean out-of-distribution score."""
        return self.score_sum / len(self.scores) if self.scores else 0.0


class DriftWatch:
    """One model version's window, fed its batches' outputs, and the model's two gauges (prediction, embedding),
    made by `gauges` when the first batch comes: a model that has computed nothing shows none."""

    def __init__(self, reference: Reference, size: int, gauges: Callable[[], tuple[Settable, Settable]]) -> None:
        self.reference = reference
        self.window = DriftWindow(size, reference.prior)
        self.make_gauges = gauges
        self.gauges: tuple[Settable, Settable] | None = None

    def add(self, outputs: Sequence[Any]) -> None:
        """A batch's outputs (`ImageOutput`s, each with its embedding: a watched model computes one for every
        image) into the window, and the gauges set."""
        kept = [o for o in outputs if isinstance(o, ImageOutput) and o.embedding is not None]
        if not kept:
            return
        probabilities = torch.stack([o.probabilities for o in kept]).float()
        embeddings = torch.stack([o.embedding for o in kept if o.embedding is not None])
        scores = self.reference.scores(embeddings, probabilities).tolist()
        self.window.add(probabilities.argmax(-1).tolist(), scores)
        if self.gauges is None:
            self.gauges = self.make_gauges()
        prediction, embedding = self.gauges
        prediction.set(self.window.prediction_drift())
        embedding.set(self.window.embedding_drift())


class Watching:
    """A batcher's observer: `metrics`, and `watch` fed each batch's outputs."""

    def __init__(self, metrics: BatchObserver, watch: DriftWatch) -> None:
        self.metrics = metrics
        self.watch = watch

    def batch_done(self, size: int, seconds: float, outputs: Sequence[object]) -> None:
        self.metrics.batch_done(size, seconds, outputs)
        try:
            self.watch.add(outputs)
        except Exception:  # a gauge never fails the batch whose requests wait for its outputs
            log.exception("drift gauges: a batch's images could not be added to the window")

    def dropped(self, reason: str, count: int) -> None:
        self.metrics.dropped(reason, count)

    def queue_depth(self, depth: int) -> None:
        self.metrics.queue_depth(depth)
