"""Quantize a checkpoint's graph to int8 with calibration images, ahead of serving.

    python -m app.quantize weights/vit-shapes.safetensors --calibration shapes
    python -m app.quantize models/mine.safetensors --calibration data/calibration --images 256

Static quantization fixes the int8 range of every activation from representative images, where
VIT_BACKEND=onnxruntime-int8 without a stored graph quantizes activations per batch (dynamic). The
graph is written beside the checkpoint as NAME.int8.onnx, marked with the checkpoint's content hash;
the service with VIT_BACKEND=onnxruntime-int8 loads it for that checkpoint and refuses it for any other.
`--calibration` is a folder of images (recursively), decoded and preprocessed exactly as the service
does, or `shapes` for the procedural dataset the bundled model was trained on.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from app.batch.inputs import IMAGE_SUFFIXES, expand_inputs
from app.core.backends.onnx_runtime import OnnxExportError, int8_graph_path, quantize_static_int8
from app.core.contract.errors import ServiceError
from app.core.images.decode import decode_image
from app.core.images.prepare import Preprocessor
from app.settings import Settings
from model.arguments import at_least
from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.shapes import make_sample

MAX_IMAGE_PIXELS: int = Settings.model_fields["max_image_pixels"].default  # the service's own limit
JPEG_DRAFT: bool = Settings.model_fields["jpeg_draft"].default  # and its own decoding of large JPEGs


def calibration_images(source: str, checkpoint: Checkpoint, count: int) -> Iterator[torch.Tensor]:
    """Up to `count` preprocessed images: from a folder (sorted, recursively), or generated `shapes`."""
    preprocess = Preprocessor(checkpoint.preprocessing)
    channels = checkpoint.config.in_channels
    draft_to = checkpoint.preprocessing.resize_size if JPEG_DRAFT else None
    if source == "shapes":
        seed = int(checkpoint.training.get("seed", 0))  # the training set's own seed
        for i in range(count):
            yield preprocess(make_sample(seed, i).image.convert("L" if channels == 1 else "RGB"))
        return
    files = [Path(f) for f in expand_inputs([source])]  # the batch runner's rule for a folder: its images, sorted
    if not files:
        raise SystemExit(f"--calibration {source}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) in it")
    for path in files[:count]:
        try:
            yield preprocess(decode_image(path.read_bytes(), str(path), channels, MAX_IMAGE_PIXELS, draft_to))
        except ServiceError as e:
            print(f"skipping {path}: {e.detail}", file=sys.stderr)


def batches(images: Iterator[torch.Tensor], size: int) -> Iterator[np.ndarray]:
    while chunk := list(itertools.islice(images, size)):
        yield torch.stack(chunk).numpy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="the .safetensors checkpoint to quantize")
    p.add_argument("--calibration", required=True, help="a folder of representative images, or 'shapes'")
    p.add_argument("--images", type=at_least(1), default=256, help="calibration images to use (default 256)")
    p.add_argument("--batch-size", type=at_least(1), default=16, help="images per calibration batch")
    p.add_argument(
        "--method",
        choices=["minmax", "entropy", "percentile"],
        default="minmax",
        help="how activation ranges are chosen from the calibration (default minmax)",
    )
    p.add_argument(
        "--output", type=Path, help="where to write the graph (default: NAME.int8.onnx beside the checkpoint)"
    )
    args = p.parse_args(argv)
    if args.calibration != "shapes" and not Path(args.calibration).is_dir():
        p.error(f"--calibration {args.calibration}: not a folder (or 'shapes')")
    try:
        checkpoint = load_checkpoint(args.checkpoint)
    except CheckpointError as e:
        p.error(str(e))
    if checkpoint.zero_shot is not None:
        p.error(f"{args.checkpoint} is a zero-shot model (CLIP, SigLIP); int8 graphs are made for classifiers")
    output = args.output or int8_graph_path(args.checkpoint)
    started = time.perf_counter()
    config = checkpoint.config
    shape = (config.in_channels, config.image_size, config.image_size)
    images = calibration_images(args.calibration, checkpoint, args.images)
    try:
        quantize_static_int8(
            checkpoint.model.eval(),
            shape,
            batches(images, args.batch_size),
            checkpoint.content_hash,
            output,
            args.method,
        )
    except OnnxExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {output}: static int8 for {args.checkpoint.name} (content hash {checkpoint.version}), "
        f"calibrated on {args.calibration} ({args.method}) in {time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
