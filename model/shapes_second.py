"""A second renderer of the `shapes` task, to measure how a model generalises: held out from training.

It draws the task as the dataset's spec describes it (the ten shapes, filled or outlined with a stroke of 2 to
6 px, any colour with contrast, from 35 to 85 % of the side, any rotation and position, over plain, gradient, noisy, textured
or cluttered backgrounds with thin distracting lines, sometimes blurred, noisy or JPEG-compressed) with drawing
code of its own: shapes are signed areas evaluated on a supersampled grid in numpy, outlines are bands about
the edge rather than strokes drawn inward, proportions vary within each shape, and the backgrounds and
distractors are others than `model.shapes` makes. A model that learned the task, not `model.shapes`' habits,
classifies these as well as its own held-out images.

    python -m model.evaluate --checkpoint weights/vit-shapes.safetensors --dataset shapes --renderer second
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageFilter

from model.shapes import IMAGE_SIZE, SHAPE_CLASSES, ShapeSample

SUPERSAMPLE = 3
GRID = (np.arange(IMAGE_SIZE * SUPERSAMPLE) + 0.5) / SUPERSAMPLE  # pixel centres of the supersampled grid
DIAMETER = (0.35, 0.85)  # of the side
STROKE = (2.0, 6.0)  # an outline's width in px, whatever the shape's size
RING_BAND = STROKE[1] * 1.25  # a ring's band in px at the least: a quarter wider than the widest outline


def polygon(n: int, rotation: float = 0.0) -> np.ndarray:
    a = rotation + 2 * math.pi * np.arange(n) / n - math.pi / 2
    return np.stack([np.cos(a), np.sin(a)], axis=1)


def star(points: int, inner: float) -> np.ndarray:
    a = -math.pi / 2 + math.pi * np.arange(2 * points) / points
    r = np.where(np.arange(2 * points) % 2 == 0, 1.0, inner)
    return np.stack([r * np.cos(a), r * np.sin(a)], axis=1)


def parts(label: int, rng: np.random.Generator, radius: float) -> list[tuple[np.ndarray, bool]]:
    """The shape in unit coordinates (within the unit circle; `radius` px once placed) as (polygon, is_hole),
    proportions drawn from ranges that keep it what it is."""
    name = SHAPE_CLASSES[label]
    if name == "circle":
        return [(polygon(96), False)]
    if name == "square":
        return [(polygon(4, math.pi / 4), False)]
    if name == "triangle":
        return [(polygon(3), False)]
    if name == "pentagon":
        return [(polygon(5), False)]
    if name == "hexagon":
        return [(polygon(6), False)]
    if name == "star":
        return [(star(5, rng.uniform(0.38, 0.5)), False)]
    if name == "cross":
        w = rng.uniform(0.24, 0.36)
        arm = np.array([(w, -1), (w, -w), (1, -w), (1, w), (w, w), (w, 1), (-w, 1), (-w, w), (-1, w), (-1, -w)])
        return [(np.vstack([arm, [(-w, -w), (-w, -1)]]) * 0.95, False)]
    if name == "ring":  # the hole leaves a band of 0.55 to 0.7 of the radius, and never less than RING_BAND px
        band = max(rng.uniform(0.55, 0.7) * radius, RING_BAND)
        return [(polygon(96), False), (polygon(96) * (1 - band / radius), True)]
    if name == "crescent":  # the unit disk less a disk shifted right: its left arc, then the bite's edge back
        inner, shift = rng.uniform(0.75, 0.85), rng.uniform(0.45, 0.6)
        x = (1 - inner**2 + shift**2) / (2 * shift)  # where the two circles cross
        y = math.sqrt(max(1 - x**2, 0.0))
        a_out, a_in = math.atan2(y, x), math.atan2(y, x - shift)
        outer = np.linspace(a_out, 2 * math.pi - a_out, 160)
        bite = np.linspace(2 * math.pi - a_in, a_in, 120)[1:-1]
        edge = np.stack([np.cos(outer), np.sin(outer)], axis=1)
        return [(np.vstack([edge, np.stack([shift + inner * np.cos(bite), inner * np.sin(bite)], axis=1)]), False)]
    if name == "arrow":
        head, shaft = rng.uniform(0.55, 0.8), rng.uniform(0.2, 0.32)
        neck = rng.uniform(0.05, 0.35)
        return [
            (
                np.array(
                    [(1, 0), (neck, -head), (neck, -shaft), (-1, -shaft), (-1, shaft), (neck, shaft), (neck, head)]
                ),
                False,
            )
        ]
    raise ValueError(f"unknown shape label {label}")


def inside(points: np.ndarray) -> np.ndarray:
    """Even-odd point-in-polygon of every supersampled pixel: (H, W) bool."""
    x, y = GRID[None, :], GRID[:, None]
    result = np.zeros((GRID.size, GRID.size), dtype=bool)
    for (x0, y0), (x1, y1) in zip(points, np.roll(points, -1, axis=0), strict=True):
        if y0 == y1:
            continue
        crosses = (y0 > y) != (y1 > y)
        at = x0 + (y - y0) * (x1 - x0) / (y1 - y0)
        result ^= crosses & (x < at)
    return result


def distance_to_edges(points: np.ndarray) -> np.ndarray:
    """Distance of every supersampled pixel to the polygon's boundary, in pixels: (H, W)."""
    x, y = GRID[None, :], GRID[:, None]
    best = np.full((GRID.size, GRID.size), np.inf)
    for (x0, y0), (x1, y1) in zip(points, np.roll(points, -1, axis=0), strict=True):
        dx, dy = x1 - x0, y1 - y0
        t = np.clip(((x - x0) * dx + (y - y0) * dy) / max(dx * dx + dy * dy, 1e-12), 0, 1)
        best = np.minimum(best, np.hypot(x - (x0 + t * dx), y - (y0 + t * dy)))
    return best


def coverage(label: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(coverage in [0, 1], silhouette) at IMAGE_SIZE: the shape placed, filled or outlined."""
    radius = rng.uniform(*DIAMETER) * IMAGE_SIZE / 2
    outlined, width = rng.random() >= 0.5, rng.uniform(*STROKE)
    margin = radius + (width / 2 if outlined else 0.0) + 0.5
    cx, cy = rng.uniform(margin, IMAGE_SIZE - margin), rng.uniform(margin, IMAGE_SIZE - margin)
    angle = rng.uniform(0, 2 * math.pi)
    rotation = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    placed = [(unit @ rotation.T * radius + (cx, cy), hole) for unit, hole in parts(label, rng, radius)]
    silhouette = np.zeros((GRID.size, GRID.size), dtype=bool)
    for points, hole in placed:
        silhouette = silhouette & ~inside(points) if hole else silhouette | inside(points)
    if not outlined:
        drawn = silhouette
    else:  # a band `width` px wide centred on the edge: half inside, half out
        drawn = np.min([distance_to_edges(points) for points, _ in placed], axis=0) <= width / 2

    def down(a: np.ndarray) -> np.ndarray:
        return a.reshape(IMAGE_SIZE, SUPERSAMPLE, IMAGE_SIZE, SUPERSAMPLE).mean(axis=(1, 3))

    return down(drawn.astype(np.float64)), down(silhouette.astype(np.float64)) >= 0.5


def smooth_noise(rng: np.random.Generator, cells: int) -> np.ndarray:
    """Value noise: a coarse random grid, bilinearly upsampled -> (IMAGE_SIZE, IMAGE_SIZE) in [0, 1]."""
    coarse = Image.fromarray((rng.random((cells, cells)) * 255).astype(np.uint8))
    return np.asarray(coarse.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC), dtype=np.float64) / 255


def backdrop(rng: np.random.Generator) -> np.ndarray:
    """Plain, linear or radial gradient, smooth noise, stripes or checks, or clutter: (H, W, 3) in [0, 255]."""
    a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    yy, xx = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] / (IMAGE_SIZE - 1)
    kind = rng.integers(6)
    if kind == 0:
        t = np.zeros((IMAGE_SIZE, IMAGE_SIZE))
    elif kind == 1:
        t = np.clip(np.hypot(xx - rng.random(), yy - rng.random()) / rng.uniform(0.5, 1.2), 0, 1)
    elif kind == 2:
        t = smooth_noise(rng, int(rng.integers(3, 9)))
    elif kind == 3:
        period, phase = rng.uniform(4, 14), rng.uniform(0, 2 * math.pi)
        direction = rng.uniform(0, math.pi)
        wave = np.sin(2 * math.pi * (xx * math.cos(direction) + yy * math.sin(direction)) * IMAGE_SIZE / period + phase)
        t = 0.5 + 0.5 * wave if rng.random() < 0.5 else (wave > 0).astype(np.float64)
        t *= rng.uniform(0.2, 0.5)
    elif kind == 4:
        t = xx * math.cos(rng.uniform(0, 2 * math.pi)) + yy * math.sin(rng.uniform(0, 2 * math.pi))
        t = (t - t.min()) / (np.ptp(t) + 1e-9)
    else:  # clutter: small dots and specks
        t = np.zeros((IMAGE_SIZE, IMAGE_SIZE))
        for _ in range(rng.integers(6, 20)):
            r = rng.uniform(0.6, 2.0)
            t = np.maximum(
                t,
                (
                    np.hypot(xx * IMAGE_SIZE - rng.uniform(0, IMAGE_SIZE), yy * IMAGE_SIZE - rng.uniform(0, IMAGE_SIZE))
                    < r
                )
                * rng.uniform(0.3, 0.8),
            )
    return a * (1 - t[..., None]) + b * t[..., None]


def lines(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Zero to three thin curves across the image, each in a colour of its own."""
    yy, xx = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float64)
    for _ in range(rng.integers(0, 4)):
        x0, y0 = rng.uniform(0, IMAGE_SIZE, 2)
        angle, bend = rng.uniform(0, math.pi), rng.uniform(-0.03, 0.03)
        along = (xx - x0) * math.cos(angle) + (yy - y0) * math.sin(angle)
        across = -(xx - x0) * math.sin(angle) + (yy - y0) * math.cos(angle) - bend * along**2
        weight = np.clip(1.0 - np.abs(across) / rng.uniform(0.5, 0.9), 0, 1)[..., None]
        image = image * (1 - weight) + rng.uniform(0, 255, 3) * weight
    return image


def luma(rgb: np.ndarray) -> float:
    return float(np.asarray(rgb).reshape(-1, 3).mean(0) @ np.array([0.299, 0.587, 0.114]) / 255)


def make_sample(seed: int, index: int) -> ShapeSample:
    """Sample `index` of this renderer's set with `seed`; the same pair always gives the same sample."""
    rng = np.random.default_rng([seed, index, 2])
    label = int(rng.integers(len(SHAPE_CLASSES)))
    image = lines(backdrop(rng), rng)
    alpha, silhouette = coverage(label, rng)
    under = luma(image[silhouette]) if silhouette.any() else luma(image)
    colour = rng.uniform(0, 255, 3)
    for _ in range(200):  # a colour that stands out from what lies under the shape
        if abs(luma(colour) - under) >= 0.3:
            break
        colour = rng.uniform(0, 255, 3)
    image = image * (1 - alpha[..., None]) + colour * alpha[..., None]
    effect = rng.random()
    if effect < 0.12:
        image = image + rng.normal(0, rng.uniform(3, 10), image.shape)
    picture = Image.fromarray(np.clip(image + 0.5, 0, 255).astype(np.uint8))
    if 0.12 <= effect < 0.24:
        picture = picture.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.5, 1.1))))
    elif 0.24 <= effect < 0.36:
        buffer = io.BytesIO()
        picture.save(buffer, format="JPEG", quality=int(rng.integers(35, 86)))
        picture = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    return ShapeSample(picture, label, silhouette)
