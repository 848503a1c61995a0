"""Reference statistics of a model's embeddings, for out-of-distribution scores.

Fort, Ren and Lakshminarayanan, "Exploring the Limits of Out-of-Distribution Detection" (NeurIPS 2021): fit one
Gaussian per class to the pre-logit embeddings of in-distribution images, with class means and one covariance
shared by the classes; an image's score is its Mahalanobis distance to the nearest class mean. Higher is further
from the data the statistics came from.

The statistics travel in the checkpoint (`reference.*` tensors, outside the content hash: adding them leaves the
model's version as it is). They are computed at the end of training, or for any checkpoint from a folder of
in-distribution images:

    python -m model.reference CHECKPOINT --images DIR [--output OUT]   # class subfolders, or the model's labels
    python -m model.reference CHECKPOINT --shapes 5000                  # the procedural shapes (bundled model)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
RIDGE = 1e-3  # added to the covariance, times its mean variance: a well-conditioned inverse with few images
PREFIX = "reference."


@dataclass(frozen=True)
class Reference:
    """Class means and the shared covariance's inverse of a model's embeddings, and the class prior."""

    means: Tensor  # (C, D) float32; a class without images has a row of zeros and prior 0
    precision: Tensor  # (D, D) float32: the inverse of the shared covariance
    prior: Tensor  # (C,) float32: each class's share of the images
    images: int  # how many images the statistics came from
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

    def scores(self, embeddings: Tensor) -> Tensor:
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
        return {
            PREFIX + "means": self.means.contiguous(),
            PREFIX + "precision": self.precision.contiguous(),
            PREFIX + "prior": self.prior.contiguous(),
            PREFIX + "images": torch.tensor([self.images], dtype=torch.int64),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> Reference:
        return cls(
            tensors[PREFIX + "means"].float(),
            tensors[PREFIX + "precision"].float(),
            tensors[PREFIX + "prior"].float(),
            int(tensors[PREFIX + "images"][0]),
        )


def fit(embeddings: Tensor, labels: Tensor, num_classes: int, ridge: float = RIDGE) -> Reference:
    """Class means and the inverse of the covariance the classes share (each embedding about its own class mean),
    in float64, with a ridge of `ridge` times the mean variance so that the inverse exists."""
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
    """(embeddings (N, D), the model's top-1 (N,)) of every batch of preprocessed images."""
    embeddings, predicted = [], []
    for x in batches:
        logits, embedding, _ = model.forward_with_embedding(x)  # type: ignore[operator]
        embeddings.append(embedding.float())
        predicted.append(logits.argmax(-1))
    return torch.cat(embeddings), torch.cat(predicted)


@torch.inference_mode()
def from_labelled(
    model: torch.nn.Module, batches: Iterable[tuple[Tensor, Tensor]], num_classes: int, device: torch.device
) -> Reference:
    """Reference statistics from batches of (preprocessed images, labels), the model run on `device`."""
    embeddings, labels = [], []
    for x, y in batches:
        _, embedding, _ = model.forward_with_embedding(x.to(device))  # type: ignore[operator]
        embeddings.append(embedding.float().cpu())
        labels.append(y)
    return fit(torch.cat(embeddings), torch.cat(labels), num_classes)


def image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def folder_labels(folder: Path, files: list[Path], classes: list[str]) -> Tensor | None:
    """Labels from class subfolders (each file's first folder under `folder`, named as one of the classes),
    or None when the files are not laid out so."""
    index = {name: i for i, name in enumerate(classes)}
    labels = []
    for f in files:
        parts = f.relative_to(folder).parts
        if len(parts) < 2 or parts[0] not in index:
            return None
        labels.append(index[parts[0]])
    return torch.tensor(labels)


def batched(items: list[Tensor], size: int) -> Iterator[Tensor]:
    for i in range(0, len(items), size):
        yield torch.stack(items[i : i + size])


def main(argv: list[str] | None = None) -> int:
    from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from model.preprocessing import EvalTransform

    p = argparse.ArgumentParser(prog="python -m model.reference", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--images", type=Path, help="in-distribution images: DIR/<class>/* labels them, else the model does"
    )
    source.add_argument("--shapes", type=int, metavar="N", help="N procedural shapes (the bundled model's data)")
    p.add_argument("--output", type=Path, help="write here (default: the checkpoint, in place)")
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)
    try:
        ckpt = load_checkpoint(args.checkpoint)
    except CheckpointError as e:
        p.exit(2, f"error: {e}\n")
    transform = EvalTransform(ckpt.preprocessing)
    if args.shapes is not None:
        from model.shapes import make_sample

        if args.shapes < 2:
            p.exit(2, "error: --shapes needs at least 2 images\n")
        samples = [make_sample(7_000_003, i) for i in range(args.shapes)]  # a stream neither train nor test uses
        pixels = [transform(s.image.convert("RGB")) for s in samples]
        labels: Tensor | None = torch.tensor([s.label for s in samples])
        described = f"{args.shapes} procedural shapes"
    else:
        if not args.images.is_dir():
            p.exit(2, f"error: --images {args.images}: not a folder\n")
        files = image_files(args.images)
        if len(files) < 2:
            p.exit(
                2, f"error: --images {args.images}: fewer than 2 image files ({', '.join(sorted(IMAGE_SUFFIXES))})\n"
            )
        pixels = []
        for f in files:
            try:
                with Image.open(f) as image:
                    pixels.append(transform(image.convert("RGB")))
            except (OSError, UnidentifiedImageError, ValueError) as e:
                p.exit(2, f"error: {f}: not a readable image ({e})\n")
        labels = folder_labels(args.images, files, ckpt.classes)
        described = f"{len(files)} images in {args.images.name}/" + (
            ", labelled by their class folders" if labels is not None else ", labelled by the model's top-1"
        )
    embeddings, predicted = embed(ckpt.model, batched(pixels, args.batch_size))
    reference = fit(embeddings, labels if labels is not None else predicted, ckpt.config.num_classes)
    training = {**ckpt.training, "reference": described}
    out = args.output or args.checkpoint
    save_checkpoint(out, ckpt.model, ckpt.classes, ckpt.preprocessing, training, reference=reference)
    scores = reference.scores(embeddings)
    seen = int((reference.prior > 0).sum())
    print(f"reference statistics from {described}: {seen} of {ckpt.config.num_classes} classes seen")
    print(f"in-distribution scores: median {scores.median():.2f}, 95th percentile {scores.quantile(0.95):.2f}")
    print(f"wrote {out} ({ckpt.identity}: unchanged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
