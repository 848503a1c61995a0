"""`shapes`: a procedural 10-class image dataset, deterministic from a seed.

Each sample is a 64x64 RGB image of one geometric shape, filled or outlined, at a random colour,
size, rotation and position, over a varied background with distractor lines and occasional blur
or JPEG re-encoding, together with the shape's pixel mask (its silhouette, interior included).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SHAPE_CLASSES: list[str] = [
    "circle",
    "square",
    "triangle",
    "pentagon",
    "hexagon",
    "star",
    "cross",
    "ring",
    "crescent",
    "arrow",
]
IMAGE_SIZE = 64
SUPERSAMPLE = 4  # shapes are drawn at 4x and downsampled, for anti-aliased edges

Polygon = list[tuple[float, float]]


@dataclass
class ShapeSample:
    image: Image.Image  # RGB, IMAGE_SIZE x IMAGE_SIZE
    label: int
    mask: np.ndarray  # (H, W) bool: pixels covered by the shape's silhouette


def regular_polygon(n: int, start: float = -math.pi / 2) -> Polygon:
    return [(math.cos(start + 2 * math.pi * i / n), math.sin(start + 2 * math.pi * i / n)) for i in range(n)]


def star_polygon(points: int = 5, inner: float = 0.45) -> Polygon:
    out: Polygon = []
    for i in range(2 * points):
        r = 1.0 if i % 2 == 0 else inner
        a = -math.pi / 2 + math.pi * i / points
        out.append((r * math.cos(a), r * math.sin(a)))
    return out


def arc(cx: float, cy: float, r: float, a0: float, a1: float, steps: int = 32) -> Polygon:
    return [
        (cx + r * math.cos(a0 + (a1 - a0) * t / steps), cy + r * math.sin(a0 + (a1 - a0) * t / steps))
        for t in range(steps + 1)
    ]


def crescent_polygon() -> Polygon:
    """Unit disk minus a disk of radius 0.8 shifted right by 0.55: outer arc, then inner arc back."""
    r2, d = 0.8, 0.55
    x = (1 - r2**2 + d**2) / (2 * d)  # where the two circles cross
    y = math.sqrt(1 - x**2)
    a_outer = math.atan2(y, x)
    a_inner = math.atan2(y, x - d)
    # Outer arc counter-clockwise round the left, then the inner circle's left arc back to the start.
    return arc(0, 0, 1.0, a_outer, 2 * math.pi - a_outer) + arc(d, 0, r2, a_inner, 2 * math.pi - a_inner)[::-1][1:-1]


def outlines(label: int) -> list[tuple[Polygon, bool]]:
    """The shape in unit coordinates (circumradius 1) as (polygon, is_hole) pairs."""
    name = SHAPE_CLASSES[label]
    if name == "circle":
        return [(regular_polygon(64), False)]
    if name == "square":
        return [(regular_polygon(4, math.pi / 4), False)]
    if name == "triangle":
        return [(regular_polygon(3), False)]
    if name == "pentagon":
        return [(regular_polygon(5), False)]
    if name == "hexagon":
        return [(regular_polygon(6), False)]
    if name == "star":
        return [(star_polygon(), False)]
    if name == "cross":
        w, L = 0.3, 0.95  # half arm width, arm length
        pts = [
            (w, -L),
            (w, -w),
            (L, -w),
            (L, w),
            (w, w),
            (w, L),
            (-w, L),
            (-w, w),
            (-L, w),
            (-L, -w),
            (-w, -w),
            (-w, -L),
        ]
        return [(pts, False)]
    if name == "ring":
        # Band of 0.65 r: at the smallest size (r = 11 px) still wider than the thickest outline (6 px),
        # so a filled ring never looks like an outlined circle.
        return [(regular_polygon(64), False), ([(0.35 * x, 0.35 * y) for x, y in regular_polygon(64)], True)]
    if name == "crescent":
        return [(crescent_polygon(), False)]
    if name == "arrow":
        pts = [(1.0, 0.0), (0.2, -0.7), (0.2, -0.28), (-1.0, -0.28), (-1.0, 0.28), (0.2, 0.28), (0.2, 0.7)]
        return [(pts, False)]
    raise ValueError(f"unknown shape label {label}")


def luminance(rgb: np.ndarray) -> float:
    return float(np.dot(np.asarray(rgb, dtype=np.float64).reshape(-1, 3).mean(0), [0.299, 0.587, 0.114]) / 255.0)


def random_colour(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, size=3).astype(np.float64)


def background(rng: np.random.Generator, size: int) -> np.ndarray:
    """Solid, linear gradient, uniform noise or soft blobs -> (size, size, 3) float in [0, 255]."""
    kind = rng.integers(4)
    base = random_colour(rng)
    if kind == 0:
        return np.broadcast_to(base, (size, size, 3)).copy()
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) / (size - 1)
    if kind == 1:
        angle = rng.uniform(0, 2 * math.pi)
        t = np.cos(angle) * xx + np.sin(angle) * yy
        t = (t - t.min()) / (t.max() - t.min() + 1e-9)
        other = random_colour(rng)
        return base * (1 - t[..., None]) + other * t[..., None]
    if kind == 2:
        amp = rng.uniform(20, 70)
        return np.clip(base + rng.uniform(-amp, amp, size=(size, size, 3)), 0, 255)
    img = np.broadcast_to(base, (size, size, 3)).copy()
    for _ in range(rng.integers(2, 6)):
        cx, cy, s = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.1, 0.35)
        w = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * s**2))[..., None] * rng.uniform(0.4, 0.9)
        img = img * (1 - w) + random_colour(rng) * w
    return img


def contrasting_colour(rng: np.random.Generator, bg: np.ndarray) -> np.ndarray:
    """A random colour whose luminance differs clearly from the background's mean."""
    bg_lum = luminance(bg)
    for _ in range(100):
        c = random_colour(rng)
        if abs(luminance(c) - bg_lum) >= 0.3:
            return c
    return np.full(3, 0.0 if bg_lum > 0.5 else 255.0)


def render_shape(label: int, rng: np.random.Generator) -> tuple[Image.Image, Image.Image]:
    """(coverage, silhouette) masks at supersampled resolution, mode L."""
    big = IMAGE_SIZE * SUPERSAMPLE
    diameter = rng.uniform(0.35, 0.85) * IMAGE_SIZE
    r = diameter / 2
    cx, cy = rng.uniform(r, IMAGE_SIZE - r), rng.uniform(r, IMAGE_SIZE - r)
    angle = rng.uniform(0, 2 * math.pi)
    ca, sa = math.cos(angle), math.sin(angle)
    filled = bool(rng.random() < 0.5)
    stroke = int(rng.integers(2, 7)) * SUPERSAMPLE
    # The circumscribed circle lies inside the image; the stroke is drawn inward so it does too.
    parts = [
        (
            [((cx + r * (ca * x - sa * y)) * SUPERSAMPLE, (cy + r * (sa * x + ca * y)) * SUPERSAMPLE) for x, y in poly],
            hole,
        )
        for poly, hole in outlines(label)
    ]
    silhouette = Image.new("L", (big, big), 0)
    d = ImageDraw.Draw(silhouette)
    for poly, hole in sorted(parts, key=lambda p: p[1]):  # outer parts first, then holes
        d.polygon(poly, fill=0 if hole else 255)
    if filled:
        return silhouette, silhouette
    outline = Image.new("L", (big, big), 0)
    d = ImageDraw.Draw(outline)
    for poly, _ in parts:
        d.line([*poly, poly[0], poly[1]], fill=255, width=2 * stroke, joint="curve")
    # Keep the stroke inside the silhouette so outlined shapes have the same extent as filled ones.
    coverage = Image.fromarray(np.minimum(np.asarray(outline), np.asarray(silhouette)))
    return coverage, silhouette


def make_sample(seed: int, index: int) -> ShapeSample:
    """Sample `index` of the dataset with this seed; the same pair always gives the same sample."""
    rng = np.random.default_rng([seed, index])
    label = int(rng.integers(len(SHAPE_CLASSES)))
    bg = background(rng, IMAGE_SIZE)
    canvas = Image.fromarray(bg.astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for _ in range(rng.integers(0, 4)):  # thin distractor lines across the background
        p = rng.uniform(0, IMAGE_SIZE, size=4)
        draw.line([(p[0], p[1]), (p[2], p[3])], fill=tuple(int(v) for v in random_colour(rng)), width=1)
    coverage, silhouette = render_shape(label, rng)
    alpha = (
        np.asarray(coverage.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX), dtype=np.float64)[..., None] / 255
    )
    colour = contrasting_colour(rng, bg)
    img = np.asarray(canvas, dtype=np.float64) * (1 - alpha) + colour * alpha
    image = Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8))
    effect = rng.random()
    if effect < 0.15:
        image = image.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.4, 1.0))))
    elif effect < 0.3:
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=int(rng.integers(40, 91)))
        image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    mask = np.asarray(silhouette.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)) >= 128
    return ShapeSample(image, label, mask)


def render_dataset(
    n: int, seed: int, sample: Callable[[int, int], ShapeSample] = make_sample
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Render samples 0..n-1 (of `sample`, a renderer's `make_sample`) -> images (n, 64, 64, 3) uint8, labels
    (n,) int64, masks (n, 64, 64) bool."""
    images = np.empty((n, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    labels = np.empty(n, dtype=np.int64)
    masks = np.empty((n, IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
    for i in range(n):
        s = sample(seed, i)
        images[i], labels[i], masks[i] = np.asarray(s.image), s.label, s.mask
    return images, labels, masks
