"""Draw an attention map over its image: what the page and `overlay=true` show."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from app.core.contract.request import Prediction

OVERLAY_MAX_SIDE = 256


def overlay_png(image: Image.Image, grid: torch.Tensor) -> bytes:
    """The map (grid, grid), upsampled and tinted red, blended over the image -> PNG (longer side <= 256 px)."""
    base = image.convert("RGB")
    scale = OVERLAY_MAX_SIDE / max(base.size)
    if scale < 1:
        base = base.resize(
            (max(1, round(base.width * scale)), max(1, round(base.height * scale))), Image.Resampling.BILINEAR
        )
    heat = Image.fromarray((grid.clamp(0, 1).numpy() * 255).astype(np.uint8))
    heat = heat.resize(base.size, Image.Resampling.BILINEAR)
    alpha = np.asarray(heat, dtype=np.float32)[..., None] / 255.0 * 0.6
    red = np.array([255.0, 30.0, 0.0], dtype=np.float32)
    blended = np.asarray(base, dtype=np.float32) * (1 - alpha) + red * alpha
    buf = io.BytesIO()
    Image.fromarray(blended.round().astype(np.uint8)).save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def with_overlays(predictions: list[Prediction], images: Sequence[Image.Image | None]) -> list[Prediction]:
    """Each prediction with its map drawn over its image (where it has both)."""
    return [
        p
        if image is None or p.attention_map is None
        else dataclasses.replace(p, overlay_png=overlay_png(image, p.attention_map))
        for p, image in zip(predictions, images, strict=True)
    ]
