"""A head taught by example, offline: `python -m model.train --head DIR --backbone NAME`.

DIR holds a folder of images per class (`DIR/<class>/*.jpg`); NAME is a checkpoint file, or a model's name in the
model repository (`--repository`, default `$VIT_MODEL_REPOSITORY`). The images are embedded by the backbone as the
service embeds them, a head is fitted on the embeddings (`model.taught_head`), and the head file is written where
the service finds it: `heads/<model>/<head>.safetensors` beside the checkpoint (in the repository, for a model of
one), the head named after DIR unless `--name` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from model.arguments import at_least
from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.preprocessing import EvalTransform
from model.taught_head import HEADS, Embedding, HeadError, RuleSetting, TaughtHead, check_head_name, fit, save

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def head_path(checkpoint: Path, head: str) -> Path:
    """Where the service finds head `head` of the model whose checkpoint is `checkpoint`."""
    return checkpoint.parent / HEADS / checkpoint.name.removesuffix(".safetensors") / f"{head}.safetensors"


def examples_in(folder: Path) -> dict[str, list[Path]]:
    """The image files of each class folder under `folder`, by class name, sorted."""
    classes: dict[str, list[Path]] = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        classes[sub.name] = sorted(f for f in sub.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
    return classes


def embedding_kind(ckpt: Checkpoint) -> Embedding:
    """What a head of this backbone reads: a zero-shot model's image in the joint space, else the pre-logits."""
    return "joint" if ckpt.zero_shot is not None else "pre-logits"


@torch.inference_mode()
def embed(ckpt: Checkpoint, pixels: Iterator[Tensor]) -> Tensor:
    """Embeddings (N, D) of batches of preprocessed images, the ones a head of this backbone reads."""
    out = []
    joint = ckpt.zero_shot is not None
    for x in pixels:
        logits, embedding, _ = ckpt.model.forward_with_embedding(x)
        out.append((logits if joint else embedding).float())
    return torch.cat(out)


def read_image(path: Path, cls: str, transform: EvalTransform) -> Tensor:
    try:
        with Image.open(path) as image:
            return transform(image.convert("RGB"))
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise HeadError(f"{path.name} (class {cls!r}) is not an image this software decodes: {e}") from None


def teach(ckpt: Checkpoint, examples: dict[str, list[Path]], rule: RuleSetting, batch_size: int) -> TaughtHead:
    """The head of `examples` (class -> image files) over `ckpt`'s embeddings."""
    for cls, files in examples.items():
        if not files:
            raise HeadError(f"class {cls!r} has no example image ({', '.join(sorted(IMAGE_SUFFIXES))})")
    transform = EvalTransform(ckpt.preprocessing)
    pixels = [read_image(f, cls, transform) for cls, files in examples.items() for f in files]
    labels = [i for i, files in enumerate(examples.values()) for _ in files]
    batches = (torch.stack(pixels[i : i + batch_size]) for i in range(0, len(pixels), batch_size))
    embeddings = embed(ckpt, batches)
    return fit(embeddings, labels, list(examples), ckpt.content_hash, embedding_kind(ckpt), rule)


def resolve_backbone(name: str, repository: Path | None) -> Path:
    """A checkpoint file given as a path, or a model's name in the repository."""
    path = Path(name)
    if path.suffix == ".safetensors" or path.is_file():
        return path
    if repository is None:
        raise HeadError(f"--backbone {name}: not a checkpoint file; for a model's name, give --repository")
    found = repository / f"{name}.safetensors"
    if not found.is_file():
        raise HeadError(f"--backbone {name}: no model named {name!r} in {repository}")
    return found


def main(argv: list[str] | None = None) -> TaughtHead:
    p = argparse.ArgumentParser(
        prog="python -m model.train --head DIR --backbone NAME", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--head", type=Path, required=True, metavar="DIR", help="DIR/<class>/* example images")
    p.add_argument("--backbone", required=True, metavar="NAME", help="a checkpoint file or a model in --repository")
    p.add_argument("--repository", type=Path, default=os.environ.get("VIT_MODEL_REPOSITORY") or None)
    p.add_argument("--name", help="the head's name (default: DIR's name)")
    p.add_argument("--output", type=Path, help="write here (default: heads/<model>/<name>.safetensors beside it)")
    p.add_argument("--rule", choices=("auto", "means", "logistic"), default="auto")
    p.add_argument("--batch-size", type=at_least(1), default=64)
    args = p.parse_args(argv)
    started = time.monotonic()
    try:
        name = check_head_name(args.name or args.head.resolve().name)
        if not args.head.is_dir():
            raise HeadError(f"--head {args.head}: not a folder (DIR/<class>/* example images)")
        checkpoint = resolve_backbone(args.backbone, args.repository)
        ckpt = load_checkpoint(checkpoint)
        head = teach(ckpt, examples_in(args.head), args.rule, args.batch_size)
    except (HeadError, CheckpointError) as e:
        p.exit(2, f"error: {e}\n")
    out = args.output or head_path(checkpoint, name)
    save(head, out)
    counts = ", ".join(f"{c} {n}" for c, n in zip(head.classes, head.counts, strict=True))
    print(f"head {name!r} on {checkpoint.name} ({ckpt.identity}): {len(head.classes)} classes ({counts})")
    if head.estimate is None:
        print(f"rule {head.rule}; no held-out estimate: a class has one example, none left to hold out")
    else:
        held = head.estimate
        print(f"rule {head.rule}: {held.accuracy:.1%} held out ({held.method}, {held.examples} examples)")
    print(f"wrote {out} in {time.monotonic() - started:.1f} s")
    return head
