"""Reference statistics of a checkpoint's embeddings (model.reference), written into it for out-of-distribution
scores: `python -m model.reference CHECKPOINT --images DIR | --shapes N [--output OUT]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from model.arguments import at_least
from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.preprocessing import EvalTransform
from model.reference import OOD_SCORES, embed, fit

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


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
    p = argparse.ArgumentParser(prog="python -m model.reference", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--images", type=Path, help="in-distribution images: DIR/<class>/* labels them, else the model does"
    )
    source.add_argument("--shapes", type=int, metavar="N", help="N procedural shapes (the bundled model's data)")
    p.add_argument("--output", type=Path, help="write here (default: the checkpoint, in place)")
    p.add_argument("--batch-size", type=at_least(1), default=64)
    p.add_argument(
        "--score",
        choices=OOD_SCORES,
        default="mahalanobis",
        help="what an image's out-of-distribution score is: the Mahalanobis distance of its embedding to the nearest "
        "class mean (default), or 1 - its top probability, for a model trained with outlier exposure",
    )
    args = p.parse_args(argv)
    try:
        ckpt = load_checkpoint(args.checkpoint)
    except CheckpointError as e:
        p.exit(2, f"error: {e}\n")
    if ckpt.zero_shot is not None:
        p.exit(
            2,
            f"error: {args.checkpoint} is a zero-shot model (CLIP, SigLIP): reference statistics are per class, "
            "and its classes are named per request\n",
        )
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
    embeddings, probabilities = embed(ckpt.model, batched(pixels, args.batch_size))
    labels = labels if labels is not None else probabilities.argmax(-1)
    reference = fit(embeddings, labels, ckpt.config.num_classes, score=args.score, probabilities=probabilities)
    training = {**ckpt.training, "reference": described}
    out = args.output or args.checkpoint
    save_checkpoint(out, ckpt.model, ckpt.classes, ckpt.preprocessing, training, reference=reference)
    scores = reference.scores(embeddings, probabilities)
    seen = int((reference.prior > 0).sum())
    print(f"reference statistics from {described}: {seen} of {ckpt.config.num_classes} classes seen")
    if reference.score != "mahalanobis":
        print(f"scored by {reference.score}: 1 - the top probability")
    shown = ".2f" if reference.score == "mahalanobis" else ".3f"  # distances run to tens; 1 - a probability, under 1
    print(f"in-distribution scores: median {scores.median():{shown}}, 95th percentile {scores.quantile(0.95):{shown}}")
    if reference.held_out_p99 is not None:
        held_out = "held out (5 folds)" if reference.score == "mahalanobis" else "of these images"
        print(f"{held_out}, 99 in 100 score at most {reference.held_out_p99:{shown}}: the page's verdict")
    print(f"wrote {out} ({ckpt.identity}: unchanged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
