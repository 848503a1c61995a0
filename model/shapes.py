"""`shapes`: a procedural 10-class image dataset, deterministic from a seed.

Each sample is a 64x64 RGB image of one geometric shape, filled or outlined (a stroke of 2 to 6 px, inside its
edge or about it), with its proportions varied within what keeps it that shape, at a random colour, size (from
0.35 to 0.85 of the side), rotation and position, over a plain, gradient (linear or radial), noisy, blotched, striped,
cluttered or natural-texture (1/f colour noise) background with thin distracting lines, and occasionally blurred
or JPEG re-encoded; together with the shape's pixel mask (its silhouette, interior included).
`make_background` draws what is none of the ten (training's outliers): those backgrounds alone, or natural
textures and backgrounds with irregular rounded regions.
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
NO_SHAPE = -1  # the label of a background drawn without a shape (`make_background`)
IMAGE_SIZE = 64
SUPERSAMPLE = 4  # shapes are drawn at 4x and downsampled, for anti-aliased edges
# The task's spec: a shape's size (its circumscribed diameter) from 35 to 85 % of the side, outlines 2 to 6 px.
SIZE_RANGE = (0.35, 0.85)
STROKE_RANGE = (2.0, 6.0)
# A ring's band is this much wider than the thickest outline, in pixels, at every size: no image is both an
# outlined circle and a ring.
RING_BAND_MARGIN = 2.0
# The share of rings and of outlines drawn near where the two meet (a ring's band within 1.5 px of the narrowest, an
# outline within 1 px of the thickest): the spec tells them apart by 2 px alone, so more of them are shown there.
NEAR_BOUNDARY = 0.35
LINES_OVER = 0.45  # the share of images whose distracting lines also cross the shape, drawn over it
SPECKS = 0.3  # the share of backgrounds cluttered with small squares and dots

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


def crescent_polygon(r2: float = 0.8, d: float = 0.55) -> Polygon:
    """Unit disk minus a disk of radius `r2` shifted right by `d`: outer arc, then inner arc back."""
    x = (1 - r2**2 + d**2) / (2 * d)  # where the two circles cross
    y = math.sqrt(1 - x**2)
    a_outer = math.atan2(y, x)
    a_inner = math.atan2(y, x - d)
    # Outer arc counter-clockwise round the left, then the inner circle's left arc back to the start.
    return arc(0, 0, 1.0, a_outer, 2 * math.pi - a_outer) + arc(d, 0, r2, a_inner, 2 * math.pi - a_inner)[::-1][1:-1]


def ring_hole(radius: float, rng: np.random.Generator) -> float:
    """A ring's hole, as a fraction of its radius (in px): from 0.3 to the widest that leaves a band of the thickest
    outline plus `RING_BAND_MARGIN` (every band the spec allows, at every size), and never wider."""
    widest = 1.0 - (STROKE_RANGE[1] + RING_BAND_MARGIN) / radius
    if rng.random() < NEAR_BOUNDARY:  # a band within 1.5 px of the narrowest, the one an outline comes closest to
        band = STROKE_RANGE[1] + RING_BAND_MARGIN + float(rng.uniform(0.0, 1.5))
        return max(1.0 - band / radius, 0.0)
    return min(float(rng.uniform(0.3, max(0.45, widest))), widest)


def outlines(label: int, rng: np.random.Generator, radius: float) -> list[tuple[Polygon, bool]]:
    """The shape in unit coordinates (circumradius 1, `radius` px once drawn) as (polygon, is_hole) pairs, its
    proportions drawn from ranges that keep it the shape it is."""
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
        return [(star_polygon(int(rng.integers(5, 7)), inner=float(rng.uniform(0.38, 0.52))), False)]
    if name == "cross":
        w, L = float(rng.uniform(0.15, 0.36)), 0.95  # half arm width, arm length
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
        hole = ring_hole(radius, rng)
        return [(regular_polygon(64), False), ([(hole * x, hole * y) for x, y in regular_polygon(64)], True)]
    if name == "crescent":
        return [(crescent_polygon(float(rng.uniform(0.74, 0.86)), float(rng.uniform(0.45, 0.62))), False)]
    if name == "arrow":
        head, shaft, neck = float(rng.uniform(0.55, 0.8)), float(rng.uniform(0.2, 0.32)), float(rng.uniform(0.05, 0.35))
        pts = [(1.0, 0.0), (neck, -head), (neck, -shaft), (-1.0, -shaft), (-1.0, shaft), (neck, shaft), (neck, head)]
        return [(pts, False)]
    raise ValueError(f"unknown shape label {label}")


def luminance(rgb: np.ndarray) -> float:
    return float(np.dot(np.asarray(rgb, dtype=np.float64).reshape(-1, 3).mean(0), [0.299, 0.587, 0.114]) / 255.0)


def random_colour(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, size=3).astype(np.float64)


def background(rng: np.random.Generator, size: int) -> np.ndarray:
    """Solid, linear or radial gradient, uniform noise, soft blobs, stripes, clutter or a natural texture ->
    (size, size, 3) float in [0, 255]."""
    kind = rng.integers(8)
    if kind == 7:
        return natural_texture(rng, size, contrast=rng.uniform(10, 45))
    base = random_colour(rng)
    if kind == 0:
        return np.broadcast_to(base, (size, size, 3)).copy()
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) / (size - 1)
    if kind in (1, 4):
        if kind == 1:
            angle = rng.uniform(0, 2 * math.pi)
            t = np.cos(angle) * xx + np.sin(angle) * yy
        else:  # radial, about a centre anywhere in the image
            t = np.sqrt((xx - rng.uniform(0, 1)) ** 2 + (yy - rng.uniform(0, 1)) ** 2)
        t = (t - t.min()) / (t.max() - t.min() + 1e-9)
        other = random_colour(rng)
        return base * (1 - t[..., None]) + other * t[..., None]
    if kind == 2:
        amp = rng.uniform(20, 70)
        return np.clip(base + rng.uniform(-amp, amp, size=(size, size, 3)), 0, 255)
    if kind == 5:  # stripes, soft or hard, 3 to 16 px apart, of a second colour from faint to strong
        angle, period = rng.uniform(0, math.pi), rng.uniform(3, 16) / size
        wave = np.sin(2 * math.pi * (np.cos(angle) * xx + np.sin(angle) * yy) / period)
        t = (wave > 0).astype(np.float64) if rng.random() < 0.5 else 0.5 + 0.5 * wave
        weight = rng.uniform(0.2, 0.75)
        return base * (1 - weight * t[..., None]) + random_colour(rng) * weight * t[..., None]
    img = np.broadcast_to(base, (size, size, 3)).copy()
    if kind == 6:  # clutter: small specks and dabs of other colours
        for _ in range(rng.integers(8, 25)):
            cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.6, 2.2) / size
            w = (((xx - cx) ** 2 + (yy - cy) ** 2) < r**2)[..., None] * rng.uniform(0.4, 0.9)
            img = img * (1 - w) + random_colour(rng) * w
        return img
    # blotches: two to eight soft spots, from small sharp ones (a spread of 3 px) to broad washes, faint or full;
    # in half the images the spots are of one colour at full weight and merge where they meet (round dark or light
    # patches as large as a shape, beside it and under it)
    if rng.random() < 0.5:
        t = np.zeros((size, size))
        for _ in range(rng.integers(3, 9)):
            cx, cy, s = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.25)
            t = np.maximum(t, np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * s**2)))
        return img * (1 - t[..., None]) + random_colour(rng) * t[..., None]
    for _ in range(rng.integers(2, 9)):
        cx, cy, s = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.35)
        w = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * s**2))[..., None] * rng.uniform(0.4, 1.0)
        img = img * (1 - w) + random_colour(rng) * w
    return img


def specks(rng: np.random.Generator, img: np.ndarray) -> np.ndarray:
    """`img` with three to twelve small squares or dots (1 to 3 px from their centre), each near the colour under
    it or of a colour of its own: the clutter the spec allows on any background."""
    size = img.shape[0]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    for _ in range(rng.integers(3, 13)):
        cx, cy, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(1.0, 3.0)
        if rng.random() < 0.5:
            inside = (np.abs(xx - cx) <= r) & (np.abs(yy - cy) <= r)
        else:
            inside = np.hypot(xx - cx, yy - cy) <= r
        under = img[int(cy) % size, int(cx) % size]
        colour = np.clip(under + rng.normal(0, 25, 3), 0, 255) if rng.random() < 0.6 else random_colour(rng)
        img = np.where(inside[..., None], colour, img)
    return img


def natural_texture(rng: np.random.Generator, size: int, contrast: float) -> np.ndarray:
    """Colour noise with a natural image's spectrum (power falling as 1/f^a, a from 1.5 to 3), about a random
    colour, each channel's deviation up to `contrast` -> (size, size, 3) float in [0, 255]."""
    fy, fx = np.meshgrid(np.fft.fftfreq(size), np.fft.fftfreq(size), indexing="ij")
    f = np.sqrt(fx**2 + fy**2)
    f[0, 0] = 1.0
    amplitude = f ** (-rng.uniform(1.5, 3.0) / 2)
    amplitude[0, 0] = 0.0
    fields = []
    for _ in range(3):
        phase = np.exp(2j * math.pi * rng.random((size, size)))
        field = np.real(np.fft.ifft2(amplitude * phase))
        fields.append(field / (field.std() + 1e-9))
    mixed = np.stack(fields, axis=-1) @ rng.uniform(-1, 1, (3, 3))  # channels that move together, as in photos
    mixed /= np.abs(mixed).max() + 1e-9
    return np.clip(random_colour(rng) + contrast * 2 * mixed, 0, 255)


def irregular_blobs(rng: np.random.Generator, img: np.ndarray) -> np.ndarray:
    """`img` (size, size, 3) with one to four filled regions whose edges wander in two to four smooth lobes
    (rounded, never pointed like a star's or square like a cross's): things in a photograph that are none of the
    ten shapes."""
    size = img.shape[0]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    for _ in range(rng.integers(1, 5)):
        cx, cy, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(0.15, 0.45) * size
        theta = np.arctan2(yy - cy, xx - cx)
        edge = np.ones_like(theta)
        for k in range(2, int(rng.integers(3, 5)) + 1):
            edge += rng.uniform(0.1, 0.3) / (k - 1) * np.cos(k * theta + rng.uniform(0, 2 * math.pi))
        inside = np.clip((r * edge - np.hypot(xx - cx, yy - cy)) / 1.5 + 0.5, 0, 1)[..., None]
        img = img * (1 - inside) + contrasting_colour(rng, img) * inside
    return img


def contrasting_colour(rng: np.random.Generator, bg: np.ndarray) -> np.ndarray:
    """A random colour whose luminance differs clearly from the mean of `bg` (the background, or its pixels under
    the shape)."""
    bg_lum = luminance(bg)
    for _ in range(100):
        c = random_colour(rng)
        if abs(luminance(c) - bg_lum) >= 0.22:
            return c
    return np.full(3, 0.0 if bg_lum > 0.5 else 255.0)


def render_shape(label: int, rng: np.random.Generator) -> tuple[Image.Image, Image.Image]:
    """(coverage, silhouette) masks at supersampled resolution, mode L."""
    big = IMAGE_SIZE * SUPERSAMPLE
    diameter = rng.uniform(*SIZE_RANGE) * IMAGE_SIZE
    r = diameter / 2
    filled = bool(rng.random() < 0.5)
    # An outline inside the edge or about it (then half of it lies outside), at any size.
    stroke = float(rng.uniform(*STROKE_RANGE))
    if rng.random() < NEAR_BOUNDARY:
        stroke = float(rng.uniform(STROKE_RANGE[1] - 1.0, STROKE_RANGE[1]))
    about = not filled and bool(rng.random() < 0.5)
    margin = min(r + (stroke / 2 + 0.5 if about else 0.0), IMAGE_SIZE / 2)
    cx, cy = rng.uniform(margin, IMAGE_SIZE - margin), rng.uniform(margin, IMAGE_SIZE - margin)
    angle = rng.uniform(0, 2 * math.pi)
    ca, sa = math.cos(angle), math.sin(angle)
    parts = [
        (
            [((cx + r * (ca * x - sa * y)) * SUPERSAMPLE, (cy + r * (sa * x + ca * y)) * SUPERSAMPLE) for x, y in poly],
            hole,
        )
        for poly, hole in outlines(label, rng, r)
    ]
    silhouette = Image.new("L", (big, big), 0)
    d = ImageDraw.Draw(silhouette)
    for poly, hole in sorted(parts, key=lambda p: p[1]):  # outer parts first, then holes
        d.polygon(poly, fill=0 if hole else 255)
    if filled:
        return silhouette, silhouette
    outline = Image.new("L", (big, big), 0)
    d = ImageDraw.Draw(outline)
    width = round(stroke * SUPERSAMPLE)
    for poly, _ in parts:
        d.line([*poly, poly[0], poly[1]], fill=255, width=width if about else 2 * width, joint="curve")
    if about:
        return outline, silhouette
    # Inside the edge: kept within the silhouette, so the outlined shape has the filled one's extent.
    coverage = Image.fromarray(np.minimum(np.asarray(outline), np.asarray(silhouette)))
    return coverage, silhouette


def make_sample(seed: int, index: int) -> ShapeSample:
    """Sample `index` of the dataset with this seed; the same pair always gives the same sample."""
    rng = np.random.default_rng([seed, index])
    return draw_sample(rng, int(rng.integers(len(SHAPE_CLASSES))))


def make_background(seed: int, index: int) -> ShapeSample:
    """A background with its distracting lines and effects, as `make_sample` draws them, but no shape: label
    `NO_SHAPE`, an empty mask. Training shows these as what is not a shape (outlier exposure)."""
    rng = np.random.default_rng([seed, index])
    kind = rng.random()
    if kind < 0.4:  # the backgrounds the shapes are drawn on
        return draw_sample(rng, NO_SHAPE)
    # structure the shapes' backgrounds lack: a natural texture at a photograph's contrast, irregular regions
    img = natural_texture(rng, IMAGE_SIZE, contrast=rng.uniform(30, 90)) if kind < 0.7 else background(rng, IMAGE_SIZE)
    if rng.random() < 0.6:
        img = irregular_blobs(rng, img)
    image = Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8))
    return ShapeSample(image, NO_SHAPE, np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool))


def distracting_lines(canvas: Image.Image, rng: np.random.Generator, count: int) -> None:
    """`count` thin lines (1 or 2 px) across `canvas`, some bent, each in a colour of its own."""
    draw = ImageDraw.Draw(canvas)
    for _ in range(count):
        p = rng.uniform(0, IMAGE_SIZE, size=6)
        points = [(p[0], p[1]), (p[2], p[3])] if rng.random() < 0.6 else [(p[0], p[1]), (p[4], p[5]), (p[2], p[3])]
        width = 1 if rng.random() < 0.75 else 2
        draw.line(points, fill=tuple(int(v) for v in random_colour(rng)), width=width, joint="curve")


def draw_sample(rng: np.random.Generator, label: int) -> ShapeSample:
    bg = background(rng, IMAGE_SIZE)
    if rng.random() < SPECKS:
        bg = specks(rng, bg)
    canvas = Image.fromarray(bg.astype(np.uint8))
    distracting_lines(canvas, rng, int(rng.integers(0, 5)))  # across the background, the shape drawn over them
    img = np.asarray(canvas, dtype=np.float64)
    mask = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
    if label != NO_SHAPE:
        coverage, silhouette = render_shape(label, rng)
        alpha = np.asarray(coverage.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX), dtype=np.float64) / 255
        mask = np.asarray(silhouette.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)) >= 128
        # the shape stands apart from the whole background, or from what lies under it (a blotch, a gradient's end)
        against = bg[mask] if mask.any() and rng.random() < 0.5 else bg
        img = img * (1 - alpha[..., None]) + contrasting_colour(rng, against) * alpha[..., None]
    image = Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8))
    if rng.random() < LINES_OVER:  # or across the shape too, drawn over it
        distracting_lines(image, rng, int(rng.integers(1, 4)))
    if rng.random() < 0.2:
        image = image.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.4, 1.2))))
    if rng.random() < 0.2:  # blurred and re-encoded, or either
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=int(rng.integers(30, 91)))
        image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
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
