"""Heads taught by example against examples per class, beside a linear probe trained on the same examples.

    python -m evaluation.taught_heads               # writes evaluation/results/taught-heads.{json,md}
    python -m evaluation.taught_heads --task size   # classes it never learnt: taught-heads-size.{json,md}

The bundled model's backbone, its ten classes drawn by the second renderer (`model.shapes_second`, which training
never saw): for 1, 5, 10, 20 and 50 examples a class, a head is taught (`model.taught_head`: `auto`, and each rule
alone) and scored on 500 other images of that renderer; beside it, `python -m model.train --freeze-backbone` trains
the checkpoint's own linear head on the same examples (as an image folder, its augmentation and schedule, the
same 500 images as its validation set), scored at its last epoch. Its classes are the ones the backbone was
trained on (from another renderer), so these figures say how close a head comes to a trained probe on the same
embeddings, not what a user's own classes reach; `--task size` asks for classes it was never taught (how much of
the image the shape spans, in three bands), the same way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.settings import BUNDLED_WEIGHTS
from evaluation import write_results
from harness.records import table
from model import train
from model.checkpoint import load_checkpoint
from model.preprocessing import EvalTransform
from model.shapes import IMAGE_SIZE, ShapeSample
from model.shapes_second import make_sample
from model.taught_head import accuracy_of, fit
from model.teach import embed

SHOTS = (1, 5, 10, 20, 50)
TEST = 500
EXAMPLE_SEED, TEST_SEED = 61, 62
PROBE_STEPS = 150  # the probe's optimizer steps at each size (epochs follow from the examples)
PROBE_BATCH = 32


# `size`: how much of the side the shape spans, in three bands with gaps between them, so that each class is clear
SIZES = {"small": (0.0, 0.48), "medium": (0.56, 0.66), "large": (0.74, 1.0)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.taught_heads", description=__doc__.split("\n\n")[0])
    p.add_argument("--shots", type=int, nargs="+", default=list(SHOTS), help="examples per class")
    p.add_argument(
        "--task",
        choices=("own", "size"),
        default="own",
        help="own: the backbone's ten shape classes; size: how much of the image the shape spans, which it never "
        "learnt to tell",
    )
    p.add_argument("--name", help="results file name (default: taught-heads, or taught-heads-size)")
    return p.parse_args()


def size_band(sample: ShapeSample) -> int | None:
    """The SIZES band the shape's extent (the larger side of its box, over the image's) falls in; None between."""
    ys, xs = np.nonzero(sample.mask)
    extent = max(ys.max() - ys.min(), xs.max() - xs.min()) / IMAGE_SIZE
    return next((k for k, (low, high) in enumerate(SIZES.values()) if low <= extent < high), None)


def labelled(task: str, seed: int) -> Iterator[tuple[Any, int]]:
    """(image, class index) of the seed's stream of second-renderer samples, as `task` labels them."""
    for i in itertools.count():
        sample = make_sample(seed, i)
        label = sample.label if task == "own" else size_band(sample)
        if label is not None:
            yield sample.image.convert("RGB"), label


def examples(task: str, per_class: int, classes: int) -> list[list[Any]]:
    """The first `per_class` images of each class from the example seed's stream."""
    found: list[list[Any]] = [[] for _ in range(classes)]
    stream = labelled(task, EXAMPLE_SEED)
    while min(len(f) for f in found) < per_class:
        image, label = next(stream)
        if len(found[label]) < per_class:
            found[label].append(image)
    return found


def write_folder(root: Path, images: list[list[Any]], classes: list[str]) -> None:
    for c, group in enumerate(images):
        (root / classes[c]).mkdir(parents=True, exist_ok=True)
        for i, image in enumerate(group):
            image.save(root / classes[c] / f"{i}.png")


def probe(folder: Path, per_class: int, classes: int) -> dict[str, Any]:
    """`model.train --freeze-backbone` on folder/train, validated on folder/val: its last epoch's accuracy."""
    batch = min(PROBE_BATCH, per_class * classes)  # a batch larger than the examples would take no step
    steps_per_epoch = max(1, per_class * classes // batch)
    epochs = max(5, PROBE_STEPS // steps_per_epoch)
    out = folder / "probe.safetensors"
    argv = [
        "--dataset", "imagefolder", "--data-dir", str(folder), "--init-from", str(BUNDLED_WEIGHTS),
        "--freeze-backbone", "--epochs", str(epochs), "--batch-size", str(batch), "--lr", "1e-3", "--warmup-epochs", "0",
        "--workers", "0", "--no-progress", "--output", str(out),
    ]  # fmt: skip
    started = time.monotonic()
    train.main(argv)
    metrics = json.loads(out.with_name(out.stem + ".metrics.json").read_text())
    last = metrics["epochs"][-1]
    return {
        "epochs": epochs,
        "last_epoch_accuracy": last["test_accuracy"],
        "best_accuracy": metrics["best_accuracy"],  # chosen on these test images: optimistic
        "seconds": round(time.monotonic() - started, 1),
        "command": "python -m model.train " + " ".join(a if "/" not in a else Path(a).name for a in argv),
    }


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    ckpt = load_checkpoint(BUNDLED_WEIGHTS)
    classes = list(ckpt.classes) if args.task == "own" else list(SIZES)
    transform = EvalTransform(ckpt.preprocessing)
    tests = list(itertools.islice(labelled(args.task, TEST_SEED), TEST))
    test_images = [image for image, _ in tests]
    test_labels = torch.tensor([label for _, label in tests])
    test_embeddings = embed(ckpt, iter(torch.stack([transform(i) for i in test_images]).split(250)))
    rows = []
    for shots in args.shots:
        images = examples(args.task, shots, len(classes))
        labels = [c for c, group in enumerate(images) for _ in group]
        started = time.monotonic()
        pixels = torch.stack([transform(i) for group in images for i in group])
        embeddings = embed(ckpt, iter(pixels.split(250)))
        embedded = time.monotonic() - started
        row: dict[str, Any] = {"shots": shots, "embed_s": round(embedded, 3)}
        for rule in ("auto", "means", "logistic"):
            started = time.monotonic()
            head = fit(embeddings, labels, classes, ckpt.content_hash, rule=rule)
            row[rule] = {
                "rule": head.rule,
                "accuracy": round(accuracy_of(head, test_embeddings, test_labels), 4),
                "held_out": None if head.estimate is None else round(head.estimate.accuracy, 4),
                "fit_s": round(time.monotonic() - started, 3),
            }
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_folder(folder / "train", images, classes)
            write_folder(
                folder / "val", [[i for i, label in tests if label == c] for c in range(len(classes))], classes
            )
            row["probe"] = probe(folder, shots, len(classes))
        print(row, flush=True)
        rows.append(row)
    report = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} cores for torch",
        "command": "python -m evaluation.taught_heads" + ("" if args.task == "own" else f" --task {args.task}"),
        "task": args.task,
        "classes": classes,
        "checkpoint": ckpt.identity,
        "test_images": TEST,
        "rows": rows,
    }
    write_results(
        args.name or ("taught-heads" if args.task == "own" else f"taught-heads-{args.task}"), report, markdown(report)
    )


def markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    return "\n".join(
        [
            "# Heads taught by example, against examples per class",
            "",
            f"Machine: {report['machine']}. Command: `{report['command']}`. Backbone: the bundled model "
            f"({report['checkpoint']}); {report['test_images']} second-renderer images scored. "
            + (
                "Classes: its own ten shapes, drawn by a renderer it was not trained on."
                if report.get("task", "own") == "own"
                else "Classes: how much of the side the shape spans ("
                + ", ".join(f"{name} {low:.0%} to {high:.0%}" for name, (low, high) in SIZES.items())
                + "; shapes between the bands left out), which the backbone was never taught to tell."
            ),
            "",
            *table(
                [
                    "examples a class",
                    "head (auto)",
                    "rule kept",
                    "held out",
                    "means",
                    "logistic",
                    "`--freeze-backbone`, last epoch",
                    "embed + fit",
                    "probe's training",
                ],
                [
                    [
                        r["shots"],
                        f"{r['auto']['accuracy']:.2%}",
                        r["auto"]["rule"],
                        "-" if r["auto"]["held_out"] is None else f"{r['auto']['held_out']:.2%}",
                        f"{r['means']['accuracy']:.2%}",
                        f"{r['logistic']['accuracy']:.2%}",
                        f"{r['probe']['last_epoch_accuracy']:.2%} ({r['probe']['epochs']} epochs)",
                        f"{r['embed_s'] + r['auto']['fit_s']:.2f} s",
                        f"{r['probe']['seconds']:.0f} s",
                    ]
                    for r in rows
                ],
                "rrlrrrrrr",
            ),
            "",
        ]
    )


if __name__ == "__main__":
    main()
