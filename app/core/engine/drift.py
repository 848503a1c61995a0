"""Drift of a model's live traffic from its reference data, over a sliding window of the last images it computed.

Two gauges per model (Prometheus `vit_drift_score{model, kind}`), for a checkpoint with reference statistics:
- `prediction`: the total variation distance between the window's predicted classes and the reference's class
  prior, from 0 (the same mix of classes as the reference data) to 1 (none of the classes it had);
- `embedding`: the window's mean out-of-distribution score (the Mahalanobis distance of each image's embedding
  to the nearest class mean; model/reference/), in the same units as `ood_score`.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


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
