"""Evaluate a checkpoint: accuracy, per-class accuracy, confusion matrix, and for `shapes` the
pointing game of its attention maps.

    python -m model.evaluate --checkpoint weights/vit-shapes.safetensors --dataset shapes

The pointing game counts a hit when the peak patch of an image's attention map contains at least
one pixel of the shape's silhouette; the score is the share of hits over the test images.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from model import shapes, shapes_outlines, shapes_second, shapes_third
from model.arguments import at_least
from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.data import DATASETS, DataOptions, DatasetNotFoundError, ShapesDataset, build_data
from model.preprocessing import EvalTransform
from model.rollout import GRADIENT, MAP_METHODS, attention_map, gradient_attention_map
from model.shapes import ShapeSample
from model.version import numeric_version

DEFAULT_SHAPES_EVAL_SEED = 20261121  # never used for training: a fresh held-out set
# The shapes renderers: the one training uses, a second and a third drawn apart (the third from the model card's
# spec alone), held out to measure generalisation, and the spec's closest case of an outline and a ring, alone.
RENDERERS: dict[str, Callable[[int, int], ShapeSample]] = {
    "shapes": shapes.make_sample,
    "second": shapes_second.make_sample,
    "third": shapes_third.make_sample,
    "outlines": shapes_outlines.make_sample,
}


@dataclass
class Evaluation:
    dataset: str
    samples: int
    accuracy: float
    per_class_accuracy: dict[str, float]
    confusion_matrix: list[list[int]]  # rows: true class, columns: predicted class
    pointing_game: float | None = None
    attention_method: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m model.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--dataset", choices=DATASETS, help="default: the dataset the checkpoint was trained on")
    p.add_argument("--data-dir", type=Path, default=Path("data"))
    p.add_argument("--download", action="store_true")
    p.add_argument("--samples", type=at_least(1), default=5000, help="shapes: held-out images to render")
    p.add_argument("--seed", type=int, default=DEFAULT_SHAPES_EVAL_SEED, help="shapes: seed of the held-out set")
    p.add_argument(
        "--renderer",
        choices=list(RENDERERS),
        default="shapes",
        help="shapes: the training renderer (model/shapes.py), `second`, drawn apart (model/shapes_second.py), "
        "`third`, drawn from the model card's spec alone (model/shapes_third.py), or `outlines`, small "
        "thick-outlined circles and rings alone (model/shapes_outlines.py)",
    )
    p.add_argument("--attention", choices=MAP_METHODS, default="rollout", help="map scored by the pointing game")
    p.add_argument("--batch-size", type=at_least(1), default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def pointing_hits(maps: Tensor, masks: Tensor) -> Tensor:
    """(B, g, g) maps and (B, H, W) bool masks -> (B,) bool: does the peak patch touch the mask?"""
    B, g, _ = maps.shape
    cell = masks.shape[-1] // g
    per_patch = masks.reshape(B, g, cell, g, cell).any(dim=4).any(dim=2).reshape(B, g * g)  # (B, g*g)
    peak = maps.reshape(B, -1).argmax(dim=1)
    return per_patch[torch.arange(B), peak]


@torch.no_grad()  # not inference_mode: class-specific maps run a backward pass of their own
def evaluate(
    ckpt: Checkpoint,
    loader: DataLoader[Any],
    masks: Tensor | None = None,
    attention: str = "rollout",
    dataset: str = "",
) -> Evaluation:
    """Score the checkpoint's model on `loader`; with `masks` (aligned to the loader's order) also the pointing game."""
    model, device = ckpt.model, next(ckpt.model.parameters()).device
    k = ckpt.config.num_classes
    confusion = torch.zeros(k, k, dtype=torch.int64)
    hits, offset = 0, 0
    for x, y in loader:
        x = x.to(device)
        if masks is None:
            logits = model(x)
        else:
            if attention == GRADIENT:
                logits, maps = gradient_attention_map(model, x)
            else:
                logits, attentions = model.forward_with_attention(x)
                maps = attention_map(attentions, attention, model.readout)
            hits += int(pointing_hits(maps.cpu(), masks[offset : offset + len(y)]).sum())
        preds = logits.argmax(1).cpu()
        confusion += torch.bincount(y * k + preds, minlength=k * k).reshape(k, k)
        offset += len(y)
    per_class = confusion.diag().float() / confusion.sum(1).clamp_min(1).float()
    return Evaluation(
        dataset=dataset,
        samples=offset,
        accuracy=float(confusion.diag().sum()) / max(1, offset),
        per_class_accuracy={c: round(float(a), 4) for c, a in zip(ckpt.classes, per_class, strict=False)},
        confusion_matrix=confusion.tolist(),
        pointing_game=hits / offset if masks is not None and offset else None,
        attention_method=attention if masks is not None else None,
    )


def format_report(e: Evaluation, classes: list[str]) -> str:
    lines = [f"{e.dataset}: {e.samples} images, top-1 accuracy {e.accuracy:.4f}"]
    if e.pointing_game is not None:
        lines.append(f"pointing game ({e.attention_method}): {e.pointing_game:.4f}")
    lines.append("per-class accuracy:")
    lines += [f"  {c:>12s}  {a:.4f}" for c, a in e.per_class_accuracy.items()]
    width = max(6, max(len(c) for c in classes) + 1)
    lines.append("confusion matrix (rows: true, columns: predicted):")
    lines.append(" " * width + "".join(f"{i:>6d}" for i in range(len(classes))))
    for c, row in zip(classes, e.confusion_matrix, strict=False):
        lines.append(f"{c:>{width}s}" + "".join(f"{v:>6d}" for v in row))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Evaluation:
    args = parse_args(argv)
    try:
        ckpt = load_checkpoint(args.checkpoint, args.device)
    except CheckpointError as e:
        raise SystemExit(str(e)) from None  # what is wrong with which file: no traceback
    if ckpt.zero_shot is not None:
        raise SystemExit(f"{args.checkpoint} is a zero-shot model (CLIP, SigLIP); this evaluates a classifier's head")
    dataset = args.dataset or ckpt.training.get("dataset") or "shapes"
    masks = None
    if dataset == "shapes":
        test = ShapesDataset(args.samples, args.seed, EvalTransform(ckpt.preprocessing), RENDERERS[args.renderer])
        masks = test.masks
    else:
        opts = DataOptions(
            dataset=dataset,
            data_dir=args.data_dir,
            download=args.download,
            image_size=ckpt.preprocessing.image_size,
            channels=ckpt.preprocessing.channels,
        )
        try:
            test = build_data(opts).test  # type: ignore[assignment]
        except DatasetNotFoundError as e:
            raise SystemExit(str(e)) from None  # where the files should be and how to get them
    loader = DataLoader(test, batch_size=args.batch_size, shuffle=False)
    named = f"{dataset}, {args.renderer} renderer" if dataset == "shapes" and args.renderer != "shapes" else dataset
    result = evaluate(ckpt, loader, masks, args.attention, named)
    print(format_report(result, ckpt.classes))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "checkpoint": str(args.checkpoint),
                    "version": numeric_version(ckpt.content_hash),  # as the service names it
                    "content_hash": ckpt.version,
                    **asdict(result),
                },
                indent=2,
            )
        )
    return result


if __name__ == "__main__":
    main()
