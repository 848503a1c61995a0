"""The case of the `shapes` spec where an outline and a ring come closest, held out to measure it: small circles
(35 to 50 % of the side) outlined at the spec's thickest strokes (5 to 6 px, inside the edge or about it), and
rings of the same sizes whose band is wider than any outline (8 px and up), half each, on `model.shapes`'
backgrounds, drawn with PIL ellipses of their own.

    python -m model.evaluate --checkpoint weights/vit-shapes.safetensors --dataset shapes --renderer outlines
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from model.shapes import IMAGE_SIZE, SHAPE_CLASSES, ShapeSample, background, contrasting_colour

SUPERSAMPLE = 4
CIRCLE, RING = SHAPE_CLASSES.index("circle"), SHAPE_CLASSES.index("ring")


def make_sample(seed: int, index: int) -> ShapeSample:
    """Sample `index` (even: an outlined circle, odd: a ring) of this set with `seed`; the same pair, the same image."""
    rng = np.random.default_rng([seed, index, 3])
    label = CIRCLE if index % 2 == 0 else RING
    bg = background(rng, IMAGE_SIZE)
    r = rng.uniform(0.35, 0.5) * IMAGE_SIZE / 2
    cx, cy = rng.uniform(r + 4, IMAGE_SIZE - r - 4, 2)
    if label == CIRCLE:
        stroke = rng.uniform(5.0, 6.0)
        outer, inner = (r, r - stroke) if rng.random() < 0.5 else (r + stroke / 2, r - stroke / 2)
    else:
        outer, inner = r, r - max(rng.uniform(0.55, 0.7) * r, 8.0)
    drawn, silhouette = disc(cx, cy, outer, inner), disc(cx, cy, outer, inner if label == RING else 0.0)
    alpha = np.asarray(drawn.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX), dtype=np.float64) / 255
    image = bg * (1 - alpha[..., None]) + contrasting_colour(rng, bg) * alpha[..., None]
    mask = np.asarray(silhouette.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)) >= 128
    return ShapeSample(Image.fromarray(np.clip(image + 0.5, 0, 255).astype(np.uint8)), label, mask)


def disc(cx: float, cy: float, outer: float, inner: float) -> Image.Image:
    """A disc of radius `outer` less one of radius `inner`, supersampled, mode L."""
    canvas = Image.new("L", (IMAGE_SIZE * SUPERSAMPLE, IMAGE_SIZE * SUPERSAMPLE), 0)
    draw = ImageDraw.Draw(canvas)
    for radius, fill in ((outer, 255), (inner, 0)):
        if radius > 0:
            s = SUPERSAMPLE
            draw.ellipse([(cx - radius) * s, (cy - radius) * s, (cx + radius) * s, (cy + radius) * s], fill=fill)
    return canvas
