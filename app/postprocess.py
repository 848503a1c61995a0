"""Turn one image's model output into its JSON result: top-k, all probabilities, map, overlay."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image

from app.inference import ImageOutput
from app.schemas import AttentionMap, ImageResult, TopK

OVERLAY_MAX_SIDE = 256


def to_result(
    filename: str,
    output: ImageOutput,
    classes: list[str],
    top_k: int,
    attention: str,
    image: Image.Image | None = None,
) -> ImageResult:
    probs = output.probabilities
    values, indices = torch.topk(probs, min(top_k, len(classes)))
    result = ImageResult(
        filename=filename,
        top_k=[
            TopK(label=classes[i], index=i, probability=float(p))
            for p, i in zip(values.tolist(), indices.tolist(), strict=True)
        ],
        probabilities=probs.tolist(),
    )
    if output.attention_map is not None:
        grid = output.attention_map
        result.attention = AttentionMap(method=attention, grid=[grid.shape[0], grid.shape[1]], map=grid.tolist())
        if image is not None:
            result.overlay_png = overlay_png(image, grid)
    return result


def overlay_png(image: Image.Image, grid: torch.Tensor) -> str:
    """The map, upsampled and tinted red, blended over the image -> base64 PNG (longer side <= 256 px)."""
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
    return base64.b64encode(buf.getvalue()).decode("ascii")
