"""How well the out-of-distribution score separates a model's own data from what it never saw: AUROC.

    python -m evaluation.ood [--weights PATH] [--n 1000]

The score is the one the service gives (`ood=true`): the Mahalanobis distance of an image's embedding to the
nearest class mean, under the checkpoint's reference statistics (model/reference/). In-distribution: held-out
shapes (the evaluation stream, which neither training nor the reference statistics used). Against:
- `noisy shapes`: the same kind of shapes under heavy Gaussian noise (sigma 64 of 255);
- `low-contrast shapes`: shapes in a colour of the background's luminance (training shapes always differ from
  their background by 0.3 or more);
- `photographs`: scikit-image's sample photographs, random crops of 20 to 100 % of their shorter side, rescaled;
- `uniform noise`: every pixel uniform in [0, 255].

Each set's AUROC (the chance that a shifted image scores above an in-distribution one) for that score and for
the maximum-softmax baseline (1 - the top probability), the score Fort et al. compare against; and the share of
each set above the checkpoint's `ood_p99` (the score 99 in 100 held-out reference images stay under), which is
where the page at / says an image is unlike what the model knows.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app.settings import BUNDLED_WEIGHTS
from evaluation import write_results
from harness.shifted import PHOTOS, auroc, held_out_shapes, shifted_sets
from model.checkpoint import Checkpoint, load_checkpoint
from model.preprocessing import EvalTransform


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.ood", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--weights", type=Path, default=BUNDLED_WEIGHTS, help="a checkpoint with reference statistics")
    p.add_argument("--n", type=int, default=1000, help="images in each set")
    p.add_argument("--name", default="ood", help="results file name")
    return p.parse_args()


@torch.inference_mode()
def scores(ckpt: Checkpoint, make: Callable[[int], Image.Image], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(Mahalanobis scores, 1 - max softmax) of n images."""
    assert ckpt.reference is not None
    transform = EvalTransform(ckpt.preprocessing)
    mahalanobis, softmax = [], []
    for start in range(0, n, 100):
        x = torch.stack([transform(make(i)) for i in range(start, min(n, start + 100))])
        logits, embedding, _ = ckpt.model.forward_with_embedding(x)
        mahalanobis.append(ckpt.reference.distances(embedding))
        softmax.append(1 - logits.softmax(-1).amax(-1))
    return torch.cat(mahalanobis).numpy(), torch.cat(softmax).numpy()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    ckpt = load_checkpoint(args.weights)
    if ckpt.reference is None:
        raise SystemExit(f"{args.weights} has no reference statistics: python -m model.reference {args.weights} ...")
    sets = shifted_sets()
    started = time.perf_counter()
    kind = ckpt.reference.score
    inside_m, inside_s = scores(ckpt, held_out_shapes, args.n)
    inside = inside_m if kind == "mahalanobis" else inside_s  # what the service answers for this checkpoint
    p99 = ckpt.reference.held_out_p99
    rows: list[dict[str, Any]] = []
    by_photo: dict[str, float] = {}
    for name, make in sets.items():
        outside_m, outside_s = scores(ckpt, make, args.n)
        outside = outside_m if kind == "mahalanobis" else outside_s
        rows.append(
            {
                "set": name,
                "auroc": auroc(inside, outside),
                "auroc_mahalanobis": auroc(inside_m, outside_m),
                "auroc_max_softmax": auroc(inside_s, outside_s),
                "median_score": float(np.median(outside)),
                "above_p99": None if p99 is None else float((outside > p99).mean()),
            }
        )
        if name == "photographs":  # crop i comes from photo i % len(PHOTOS)
            by_photo = {photo: auroc(inside, outside[k :: len(PHOTOS)]) for k, photo in enumerate(PHOTOS)}
    report = {
        "weights": str(args.weights),
        "version": ckpt.version,
        "reference": ckpt.training.get("reference"),
        "score": kind,
        "images_per_set": args.n,
        "in_distribution_median_score": float(np.median(inside)),
        "in_distribution_p95_score": float(np.percentile(inside, 95)),
        "ood_p99": p99,
        "in_distribution_above_p99": None if p99 is None else float((inside > p99).mean()),
        "sets": rows,
        "photographs_by_source": by_photo,
        "seconds": time.perf_counter() - started,
    }
    served = {k: " (served)" if k == kind else "" for k in ("mahalanobis", "max_softmax")}
    f = ".2f" if kind == "mahalanobis" else ".3f"  # distances run to tens; 1 - a probability stays under 1
    lines = [
        f"# Out-of-distribution AUROC: {args.weights.name} ({ckpt.identity})",
        "",
        f"`python -m evaluation.ood --n {args.n}`; reference statistics from {report['reference']}; the served score: "
        f"{'the Mahalanobis distance' if kind == 'mahalanobis' else '1 - the top probability (max softmax)'}. "
        "In-distribution: "
        f"{args.n} held-out shapes, median score {report['in_distribution_median_score']:{f}} (95th percentile "
        f"{report['in_distribution_p95_score']:{f}}).",
        ""
        if p99 is None
        else f"\nThe checkpoint's `ood_p99` is {p99:{f}}; {report['in_distribution_above_p99']:.1%} of the held-out "
        "shapes score above it (the page calls an image above it unlike what the model knows).\n",
        f"| shifted set | AUROC, Mahalanobis{served['mahalanobis']} | AUROC, max softmax{served['max_softmax']} | "
        "median score | above ood_p99 |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {r['set']} | {r['auroc_mahalanobis']:.3f} | {r['auroc_max_softmax']:.3f} | {r['median_score']:{f}} | "
            + ("" if r["above_p99"] is None else f"{r['above_p99']:.1%}")
            + " |"
            for r in rows
        ),
        "",
        "Photographs by source (AUROC, served score): "
        + ", ".join(f"{photo} {value:.3f}" for photo, value in by_photo.items()),
        "",
    ]
    write_results(args.name, report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
