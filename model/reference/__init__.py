"""Reference statistics of a model's embeddings, for out-of-distribution scores.

Fort, Ren and Lakshminarayanan, "Exploring the Limits of Out-of-Distribution Detection" (NeurIPS 2021): fit one
Gaussian per class to the pre-logit embeddings of in-distribution images, with class means and one covariance
shared by the classes; an image's score is its Mahalanobis distance to the nearest class mean. Higher is further
from the data the statistics came from.

A model trained to answer equal probabilities for what is none of its classes (outlier exposure, Hendrycks,
Mazeika and Dietterich, ICLR 2019: `model.train --shapes-outliers`) is better scored by 1 - its top probability
(the maximum-softmax score it was trained for). Statistics fitted with `score="max_softmax"` say so, and score so;
the class prior and `held_out_p99` are kept for either score.

The statistics travel in the checkpoint (`reference.*` tensors, outside the content hash: adding them leaves the
model's version as it is). They are computed at the end of training, or for any checkpoint from a folder of
in-distribution images (the command is this package's __main__):

    python -m model.reference CHECKPOINT --images DIR [--output OUT]   # class subfolders, or the model's labels
    python -m model.reference CHECKPOINT --shapes 5000                  # the procedural shapes (bundled model)

This module imports nothing else of the project's, so `model.checkpoint` reads statistics through it while the
command, which reads and writes checkpoints, lives apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor

RIDGE = 1e-3  # added to the covariance, times its mean variance: a well-conditioned inverse with few images
FOLDS = 5  # the held-out scores: each fifth of the images scored by statistics fitted on the other four
PREFIX = "reference."
OodScore = Literal["mahalanobis", "max_softmax"]
OOD_SCORES: tuple[str, ...] = get_args(OodScore)


@dataclass(frozen=True)
class Reference:
    """Class means and the shared covariance's inverse of a model's embeddings, and the class prior."""

    means: Tensor  # (C, D) float32; a class without images has a row of zeros and prior 0
    precision: Tensor  # (D, D) float32: the inverse of the shared covariance
    prior: Tensor  # (C,) float32: each class's share of the images
    images: int  # how many images the statistics came from
    # The score 99 in 100 in-distribution images stay at or below, each scored by statistics fitted without
    # it (5 folds); None for statistics of fewer than FOLDS * 2 images, or saved before this was kept.
    held_out_p99: float | None = None
    score: OodScore = (
        "mahalanobis"  # what `scores` gives: the distance to the nearest class mean, or 1 - top probability
    )
    _terms: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        C, D = self.means.shape
        if self.precision.shape != (D, D) or self.prior.shape != (C,):
            raise ValueError(
                f"reference statistics disagree: means {tuple(self.means.shape)}, precision "
                f"{tuple(self.precision.shape)}, prior {tuple(self.prior.shape)}"
            )
        if self.score not in OOD_SCORES:
            raise ValueError(f"reference score must be one of {', '.join(OOD_SCORES)}, got {self.score!r}")

    def scores(self, embeddings: Tensor, probabilities: Tensor) -> Tensor:
        """(B, D) embeddings and their (B, C) probabilities -> (B,) out-of-distribution scores, as `score` says."""
        if self.score == "max_softmax":
            return 1 - probabilities.float().amax(dim=-1)
        return self.distances(embeddings)

    def distances(self, embeddings: Tensor) -> Tensor:
        """(B, D) embeddings -> (B,) Mahalanobis distance to the nearest class mean (classes seen only):
        sqrt(min_c (z - mu_c)^T P (z - mu_c)), as z^T P z - 2 z^T (P mu_c) + mu_c^T P mu_c."""
        z = embeddings.float()
        precision, projected, offset = self.terms(z.device)
        squared = (z @ precision * z).sum(-1, keepdim=True) - 2 * z @ projected + offset  # (B, C)
        return squared.amin(dim=-1).clamp_min(0).sqrt()

    def terms(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """P, (P mu_c) as columns (D, C), and mu_c^T P mu_c (C,) on `device`, +inf for classes never seen;
        made once per device."""
        cached = self._terms.get(device)
        if cached is None:
            projected = self.means @ self.precision  # (C, D)
            offset = (projected * self.means).sum(-1).masked_fill(self.prior == 0, float("inf"))
            cached = (self.precision.to(device), projected.T.contiguous().to(device), offset.to(device))
            self._terms[device] = cached
        return cached

    def tensors(self) -> dict[str, Tensor]:
        out = {
            PREFIX + "means": self.means.contiguous(),
            PREFIX + "precision": self.precision.contiguous(),
            PREFIX + "prior": self.prior.contiguous(),
            PREFIX + "images": torch.tensor([self.images], dtype=torch.int64),
        }
        if self.held_out_p99 is not None:
            out[PREFIX + "held_out_p99"] = torch.tensor([self.held_out_p99], dtype=torch.float32)
        if self.score != "mahalanobis":  # statistics saved before scores had kinds are Mahalanobis
            out[PREFIX + "score"] = torch.tensor(list(self.score.encode()), dtype=torch.uint8)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> Reference:
        p99 = tensors.get(PREFIX + "held_out_p99")
        score = tensors.get(PREFIX + "score")
        return cls(
            tensors[PREFIX + "means"].float(),
            tensors[PREFIX + "precision"].float(),
            tensors[PREFIX + "prior"].float(),
            int(tensors[PREFIX + "images"][0]),
            None if p99 is None else float(p99[0]),
            "mahalanobis" if score is None else bytes(score.tolist()).decode(),  # type: ignore[arg-type]
        )


def fit(
    embeddings: Tensor,
    labels: Tensor,
    num_classes: int,
    ridge: float = RIDGE,
    score: OodScore = "mahalanobis",
    probabilities: Tensor | None = None,
) -> Reference:
    """Class means and the inverse of the covariance the classes share (each embedding about its own class mean),
    in float64, with a ridge of `ridge` times the mean variance so that the inverse exists; and the 99th
    percentile of the images' held-out scores (`held_out_p99`). With score="max_softmax", the images'
    `probabilities` (N, C) give the scores, which no fit depends on."""
    fitted = fit_once(embeddings, labels, num_classes, ridge)
    if score == "max_softmax":
        if probabilities is None:
            raise ValueError("max_softmax scores need the images' probabilities")
        scored = dataclasses.replace(fitted, score="max_softmax")
        p99 = scored.scores(embeddings, probabilities).quantile(0.99)
        return dataclasses.replace(scored, held_out_p99=float(p99)) if embeddings.shape[0] >= FOLDS * 2 else scored
    n = embeddings.shape[0]
    if n < FOLDS * 2:
        return fitted
    fold = torch.arange(n) % FOLDS
    held_out = torch.cat(
        [
            fit_once(embeddings[fold != k], labels[fold != k], num_classes, ridge).distances(embeddings[fold == k])
            for k in range(FOLDS)
        ]
    )
    held_out = held_out[held_out.isfinite()]  # an image of a class its fold's statistics never saw has no score
    if held_out.numel() == 0:
        return fitted
    return dataclasses.replace(fitted, held_out_p99=float(held_out.quantile(0.99)))


def fit_once(embeddings: Tensor, labels: Tensor, num_classes: int, ridge: float) -> Reference:
    if embeddings.shape[0] < 2:
        raise ValueError(f"reference statistics need at least 2 images, got {embeddings.shape[0]}")
    z, y = embeddings.double(), labels.long()
    counts = torch.bincount(y, minlength=num_classes).double()
    means = torch.zeros(num_classes, z.shape[1], dtype=torch.float64).index_add_(0, y, z)
    means = means / counts.clamp_min(1)[:, None]
    centred = z - means[y]
    covariance = centred.T @ centred / z.shape[0]
    covariance += ridge * covariance.diagonal().mean().clamp_min(1e-12) * torch.eye(z.shape[1], dtype=torch.float64)
    precision = torch.linalg.inv(covariance)
    precision = (precision + precision.T) / 2  # exactly symmetric
    return Reference(means.float(), precision.float(), (counts / counts.sum()).float(), int(z.shape[0]))


@torch.inference_mode()
def embed(model: torch.nn.Module, batches: Iterable[Tensor]) -> tuple[Tensor, Tensor]:
    """(embeddings (N, D), probabilities (N, C)) of every batch of preprocessed images."""
    embeddings, probabilities = [], []
    for x in batches:
        logits, embedding, _ = model.forward_with_embedding(x)  # type: ignore[operator]
        embeddings.append(embedding.float())
        probabilities.append(logits.float().softmax(-1))
    return torch.cat(embeddings), torch.cat(probabilities)


@torch.inference_mode()
def from_labelled(
    model: torch.nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    num_classes: int,
    device: torch.device,
    score: OodScore = "mahalanobis",
) -> Reference:
    """Reference statistics from batches of (preprocessed images, labels), the model run on `device`."""
    embeddings, probabilities, labels = [], [], []
    for x, y in batches:
        logits, embedding, _ = model.forward_with_embedding(x.to(device))  # type: ignore[operator]
        embeddings.append(embedding.float().cpu())
        probabilities.append(logits.float().softmax(-1).cpu())
        labels.append(y)
    return fit(
        torch.cat(embeddings), torch.cat(labels), num_classes, score=score, probabilities=torch.cat(probabilities)
    )
