"""What every source converter returns, and the check that the conversion is exact."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from model.preprocessing import EvalTransform, Preprocessing
from model.vit import ViT, ViTConfig
from model.zero_shot import ZeroShot, ZeroShotConfig

# Logits of the converted model may differ from the library's by float rounding only; anything
# above this (relative to the logits' scale) means a feature was missed, and nothing is written.
MAX_RELATIVE_LOGIT_DIFF = 1e-4
# The source library's own processor and the checkpoint's preprocessing, on the same image files, may differ by
# rounding: a pixel a level of 255 apart here and there (two resize kernels rounding one value each way). A wrong
# mean, resize or crop moves most pixels by several levels.
MAX_PIXEL_LEVELS = 1.01
MAX_MEAN_PIXEL_LEVELS = 0.05
# and the outputs end to end (file -> preprocessing -> model) by what such pixels move them
MAX_RELATIVE_OUTPUT_DIFF = 1e-2


class ConversionError(Exception):
    """The source cannot be converted: unreadable, or it uses a feature our ViT does not implement."""


def unsupported(feature: str, hint: str = "") -> ConversionError:
    """The one error for a feature of the source model that `model.vit.ViT` does not implement."""
    return ConversionError(f"unsupported feature: {feature}" + (f"; {hint}" if hint else ""))


@dataclass
class Converted:
    """A source model translated into our config, weights, classes and preprocessing."""

    config: ViTConfig
    state_dict: dict[str, Tensor]
    classes: list[str]
    preprocessing: Preprocessing
    reference: Callable[[Tensor], Tensor]  # the library's model: images -> logits (a zero-shot model's: embeddings)
    source: dict[str, Any] = field(default_factory=dict)  # recorded in the checkpoint
    # a CLIP or SigLIP model's text tower: its config, weights (`text.*`, `logit_scale`, `logit_bias`), tokenizer
    # file, and the library's text model (token ids -> embeddings)
    zero_shot: ZeroShotConfig | None = None
    zero_shot_state: dict[str, Tensor] = field(default_factory=dict)
    tokenizer: bytes = b""
    reference_text: Callable[[Tensor], Tensor] | None = None
    # the library's own preprocessing: a decoded RGB image file -> the (C, H, W) pixels its model takes
    preprocess: Callable[[Image.Image], Tensor] | None = None

    def build(self) -> ViT:
        """Our model with the converted weights; every tensor must find its place."""
        model = ViT(self.config)
        missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
        if missing or unexpected:
            raise ConversionError(
                f"the weights do not map onto the model: missing {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}"
            )
        return model.eval()

    def build_zero_shot(self) -> ZeroShot | None:
        """The text tower with the converted weights, or None for a classifier."""
        if self.zero_shot is None:
            return None
        tower = ZeroShot(self.zero_shot, self.tokenizer)
        missing, unexpected = tower.load_state_dict(self.zero_shot_state, strict=False)
        if missing or unexpected:
            raise ConversionError(
                f"the text tower's weights do not map: missing {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}"
            )
        return tower.eval()


@torch.inference_mode()
def logit_difference(
    model: nn.Module, reference: Callable[[Tensor], Tensor], config: ViTConfig, batch: int = 2
) -> float:
    """Largest |ours - reference| over the logits of a seeded random batch, relative to the logits' scale."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, config.in_channels, config.image_size, config.image_size, generator=generator)
    ours, theirs = model(x).float(), reference(x).float()
    if ours.shape != theirs.shape:
        raise ConversionError(f"logits have shape {tuple(ours.shape)}, the source model gives {tuple(theirs.shape)}")
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1.0))


@torch.inference_mode()
def text_difference(tower: ZeroShot, reference: Callable[[Tensor], Tensor], batch: int = 2) -> float:
    """Largest |ours - reference| over the text embeddings of seeded random token ids (each row ending in the
    end-of-text token), relative to their scale."""
    c = tower.config.text
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (batch, c.context_length), generator=generator)
    if c.pool == "eos":
        ids[:, -1] = c.eos_token_id
    ours, theirs = tower.text(ids).float(), reference(ids).float()
    if ours.shape != theirs.shape:
        raise ConversionError(f"text embeddings have shape {tuple(ours.shape)}, the source gives {tuple(theirs.shape)}")
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1.0))


def check_equal(model: nn.Module, converted: Converted, batch: int = 2) -> float:
    """Raise unless our logits (and a zero-shot model's text embeddings) equal the source model's; returns the
    largest relative difference."""
    diff = logit_difference(model, converted.reference, converted.config, batch)
    tower = converted.build_zero_shot()
    if tower is not None and converted.reference_text is not None:
        diff = max(diff, text_difference(tower, converted.reference_text, batch))
    if not diff <= MAX_RELATIVE_LOGIT_DIFF:
        raise ConversionError(
            f"the converted model's logits differ from the source model's by {diff:.2e} (relative; "
            f"limit {MAX_RELATIVE_LOGIT_DIFF:.0e}): the source uses something this converter does not map"
        )
    return diff


def check_images(p: Preprocessing) -> list[tuple[str, Image.Image]]:
    """Image files to preprocess both ways, as decoded from their bytes: JPEG and PNG, square and not, larger and
    smaller than the model's input, one whose crop margin is odd (where libraries put the odd pixel differently),
    with sharp edges and texture (a `shapes` drawing with seeded noise)."""
    from model.shapes import make_sample

    size, resized = p.image_size, p.resize_size
    odd = size + 3 + 4 * max(0, (resized - size) // 4 + 1)  # a long side cropped with a margin of 2k + 1.5 each way
    sides = [(2 * size + 6, 2 * size + 6), (3 * size // 2 + 7, size + 1), (size // 2 + 3, size + 9)]
    sides += [(size - 5, size - 5), (resized, odd)]
    files = []
    for i, (side, kind) in enumerate(zip(sides, ["png", "jpeg", "png", "jpeg", "png"], strict=True)):
        drawing = make_sample(20261127, i).image.resize(side, Image.Resampling.BICUBIC)
        noise = np.random.default_rng(i).normal(0, 12, (side[1], side[0], 3))
        pixels = np.clip(np.asarray(drawing, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
        encoded = io.BytesIO()
        Image.fromarray(pixels).save(encoded, format=kind.upper(), quality=90)
        files.append((f"{side[0]}x{side[1]}.{kind}", Image.open(io.BytesIO(encoded.getvalue())).convert("RGB")))
    return files


@torch.inference_mode()
def check_preprocessing(model: nn.Module, converted: Converted) -> dict[str, Any]:
    """Raise unless the checkpoint's preprocessing and the source library's own give the same pixels on the same
    image files, and the outputs from each file agree end to end; returns the figures for the checkpoint's record."""
    if converted.preprocess is None:
        return {}
    p = converted.preprocessing
    transform, std = EvalTransform(p), torch.tensor(p.std).view(-1, 1, 1)
    ours, theirs, worst, mean = [], [], 0.0, 0.0
    for name, image in check_images(p):
        mine, library = transform(image), converted.preprocess(image).float()
        if mine.shape != library.shape:
            raise ConversionError(
                f"on {name} the source's processor gives pixels of shape {tuple(library.shape)}, the checkpoint's "
                f"preprocessing {tuple(mine.shape)}: {describe(p)} is not what the source does"
            )
        levels = (mine - library).abs() * std * 255  # in levels of the 0-255 image
        worst, mean = max(worst, float(levels.max())), max(mean, float(levels.mean()))
        if worst > MAX_PIXEL_LEVELS or mean > MAX_MEAN_PIXEL_LEVELS:
            raise ConversionError(
                f"on {name} the checkpoint's preprocessing ({describe(p)}) differs from the source's processor by up "
                f"to {worst:.1f} levels of 255 ({mean:.2f} on average): the source preprocesses otherwise"
            )
        ours.append(mine)
        theirs.append(library)
    mine_out, library_out = model(torch.stack(ours)).float(), converted.reference(torch.stack(theirs)).float()
    diff = float((mine_out - library_out).abs().max() / library_out.abs().max().clamp_min(1.0))
    if not diff <= MAX_RELATIVE_OUTPUT_DIFF:
        raise ConversionError(
            f"from the same image files the converted model's outputs differ from the source's by {diff:.2e} "
            f"(relative; limit {MAX_RELATIVE_OUTPUT_DIFF:.0e})"
        )
    return {"checked_images": len(ours), "max_pixel_levels": round(worst, 4), "max_relative_output_diff": diff}


def describe(p: Preprocessing) -> str:
    """One line of what a Preprocessing does."""
    return (
        f"{p.resize} {p.resize_size} -> {p.image_size} px"
        + (" (odd margins floored)" if p.crop_offset == "floor" and p.resize == "center_crop" else "")
        + f", {p.interpolation} ({p.resize_backend}), mean {p.mean}, std {p.std}"
    )


def read_classes(path: Path, num_classes: int) -> list[str]:
    """One label per line (trailing blank lines ignored); the count must match the model's head."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"--classes {path}: cannot read it ({e})") from e
    while lines and not lines[-1].strip():
        lines.pop()
    labels = [line.strip() for line in lines]
    if len(labels) != num_classes:
        raise ConversionError(f"--classes {path}: {len(labels)} labels for a head with {num_classes} classes")
    if any(not label for label in labels):
        raise ConversionError(f"--classes {path}: line {labels.index('') + 1} is empty; give every class a label")
    return labels


def read_labels(path: Path) -> list[str]:
    """A zero-shot model's default class names: one per line, blank lines skipped, each once."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"--labels {path}: cannot read it ({e})") from e
    labels = [line.strip() for line in lines if line.strip()]
    if not labels:
        raise ConversionError(f"--labels {path}: no labels in it")
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ConversionError(f"--labels {path}: {', '.join(map(repr, repeated[:5]))} given more than once")
    return labels


Renames = list[tuple[re.Pattern[str], str]]


def rename_key(key: str, renames: Renames) -> str:
    """A source's tensor name in ours: the first rule that matches rewrites it; unmatched names are kept."""
    for pattern, replacement in renames:
        new = pattern.sub(replacement, key)
        if new != key:
            return new
    return key


def numbered_classes(num_classes: int) -> list[str]:
    return [f"class_{i}" for i in range(num_classes)]


def mlp_ratio(dim: int, hidden: int) -> float:
    """The ratio that makes int(dim * ratio) == hidden, as our MLP computes its width."""
    ratio = hidden / dim
    if int(dim * ratio) != hidden:  # hidden / dim rounded down a hair (512 / 192): the next float up
        ratio = math.nextafter(ratio, math.inf)
    if int(dim * ratio) != hidden:
        raise unsupported(f"an MLP width of {hidden} for width {dim} (not expressible as a ratio)")
    return ratio
