"""A third renderer of the `shapes` task, written from the model card's spec alone (weights/README.md, "What it is
trained on"), to measure how a model generalises: held out from training, and drawn with none of the other
renderers' code.

The spec, as the card gives it: the ten shapes with their proportions varied within what keeps each that shape (a
star's points and depth, a cross's arm width, a ring's hole, a crescent's bite, an arrow's head), at 35 to 85 % of
the side, any rotation and position, filled or outlined with a stroke of 2 to 6 px at every size (inside the edge
or about it), a ring's band at least 8 px; over plain, linear or radial gradient, noisy, blotched, striped,
cluttered or natural-texture backgrounds, with thin straight or bent distracting lines, sometimes blurred or JPEG
re-encoded (quality 60 to 90). Here each shape is a PIL polygon or ellipse drawn at five times the size and
reduced with a box filter; an outline is the shape's band between two offsets of its silhouette, measured by the
Euclidean distance from its edge; the backgrounds, distractors and degradations are this module's own.

    python -m model.evaluate --checkpoint weights/vit-shapes.safetensors --dataset shapes --renderer third
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from model.shapes import IMAGE_SIZE, SHAPE_CLASSES, ShapeSample

SCALE = 5  # drawn at five times the side, then reduced
SIDE = IMAGE_SIZE * SCALE
SIZE = (0.35, 0.85)  # the shape's circumscribed diameter, of the side
STROKE = (2.0, 6.0)  # an outline, in px of the final image, at every size
RING_BAND = 8.0  # a ring's band, in px, at the least
Points = list[tuple[float, float]]


def regular(n: int, turn: float) -> Points:
    return [(math.cos(turn + 2 * math.pi * k / n), math.sin(turn + 2 * math.pi * k / n)) for k in range(n)]


def star(points: int, depth: float, turn: float) -> Points:
    out = []
    for k in range(2 * points):
        r = 1.0 if k % 2 == 0 else depth
        a = turn + math.pi * k / points
        out.append((r * math.cos(a), r * math.sin(a)))
    return out


def cross(arm: float) -> Points:
    """A plus sign of arms `arm` wide (of the unit half-length), corners within the unit circle."""
    h = arm / 2
    reach = math.sqrt(1 - h * h)
    quarter = [(h, -reach), (h, -h), (reach, -h)]
    out: Points = []
    for q in range(4):
        c, s = math.cos(q * math.pi / 2), math.sin(q * math.pi / 2)
        out += [(x * c - y * s, x * s + y * c) for x, y in quarter]
    return out


def arrow(head_length: float, head_width: float, shaft: float) -> Points:
    """Pointing along +x, tip at x = 1, tail at x = -1."""
    neck = 1 - head_length
    return [
        (-1.0, -shaft / 2),
        (neck, -shaft / 2),
        (neck, -head_width / 2),
        (1.0, 0.0),
        (neck, head_width / 2),
        (neck, shaft / 2),
        (-1.0, shaft / 2),
    ]


def rotate(points: Points, angle: float) -> Points:
    c, s = math.cos(angle), math.sin(angle)
    return [(x * c - y * s, x * s + y * c) for x, y in points]


def silhouette(label: int, rng: np.random.Generator, cx: float, cy: float, r: float) -> Image.Image:
    """The shape's filled area as a mask at SCALE, `r` its circumscribed radius in px of the mask."""
    mask = Image.new("L", (SIDE, SIDE), 0)
    draw = ImageDraw.Draw(mask)
    name = SHAPE_CLASSES[label]
    turn = float(rng.uniform(0, 2 * math.pi))

    def place(points: Points) -> list[tuple[float, float]]:
        return [(cx + r * x, cy + r * y) for x, y in rotate(points, turn)]

    def disc(radius: float, at: tuple[float, float] = (0.0, 0.0), fill: int = 255) -> None:
        x, y = cx + at[0], cy + at[1]
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=fill)

    if name == "circle":
        disc(r)
    elif name in ("square", "triangle", "pentagon", "hexagon"):
        n = {"square": 4, "triangle": 3, "pentagon": 5, "hexagon": 6}[name]
        draw.polygon(place(regular(n, 0.0)), fill=255)
    elif name == "star":
        draw.polygon(place(star(int(rng.integers(5, 7)), float(rng.uniform(0.36, 0.52)), 0.0)), fill=255)
    elif name == "cross":
        draw.polygon(place(cross(float(rng.uniform(0.3, 0.5)))), fill=255)
    elif name == "ring":
        band = max(RING_BAND * SCALE, r * float(rng.uniform(0.3, 0.55)))
        disc(r)
        disc(r - band, fill=0)
    elif name == "crescent":  # a disc bitten through its edge by another
        bite = float(rng.uniform(0.7, 0.95))  # the biting disc's radius, of r
        offset = r * float(rng.uniform(1.15 - bite, 0.65))
        disc(r)
        disc(r * bite, (offset * math.cos(turn), offset * math.sin(turn)), fill=0)
    elif name == "arrow":
        head = arrow(float(rng.uniform(0.35, 0.55)), float(rng.uniform(0.7, 1.1)), float(rng.uniform(0.2, 0.35)))
        draw.polygon(place(head), fill=255)
    return mask


def outlined(mask: Image.Image, width_px: float, rng: np.random.Generator) -> Image.Image:
    """The band of `mask` `width_px` wide (px of the final image): inside its edge, or centred on it. Its width is the
    Euclidean distance from the edge, the same in every direction (a square window's erosion would make a 6 px
    outline 8.5 px across where the edge runs diagonally: as wide as a ring's narrowest band)."""
    try:
        from scipy.ndimage import distance_transform_edt  # evaluation only: scipy comes with scikit-image
    except ImportError:
        raise SystemExit("the third renderer needs scipy: .venv/bin/pip install -e '.[bench]'") from None

    w = width_px * SCALE
    inward = rng.random() < 0.5
    inside = np.asarray(mask) > 127
    depth = distance_transform_edt(inside)  # from each pixel inside to the nearest outside, in px at SCALE
    if inward:
        band = inside & (depth <= w)
    else:
        reach = distance_transform_edt(~inside)  # from each pixel outside to the nearest inside
        band = (inside & (depth <= w / 2)) | (~inside & (reach <= w / 2))
    return Image.fromarray(band.astype(np.uint8) * 255)


def power_noise(rng: np.random.Generator, exponent: float) -> np.ndarray:
    """Noise whose power falls as 1/f^exponent, scaled to 0..1."""
    f = np.fft.fftfreq(IMAGE_SIZE)
    radius = np.hypot(f[:, None], f[None, :])
    radius[0, 0] = 1.0
    spectrum = (rng.normal(size=radius.shape) + 1j * rng.normal(size=radius.shape)) / radius ** (exponent / 2)
    field = np.fft.ifft2(spectrum).real
    return (field - field.min()) / (np.ptp(field) + 1e-9)


def background(rng: np.random.Generator) -> np.ndarray:
    """RGB float 0..255, IMAGE_SIZE square."""
    kind = rng.integers(7)
    base = rng.uniform(0, 255, 3)
    other = rng.uniform(0, 255, 3)
    ys, xs = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] / (IMAGE_SIZE - 1)
    if kind == 0:  # plain
        t = np.zeros((IMAGE_SIZE, IMAGE_SIZE))
    elif kind == 1:  # linear gradient
        a = rng.uniform(0, 2 * math.pi)
        t = (xs - 0.5) * math.cos(a) + (ys - 0.5) * math.sin(a) + 0.5
    elif kind == 2:  # radial gradient
        t = np.hypot(xs - rng.uniform(0, 1), ys - rng.uniform(0, 1)) / 1.2
    elif kind == 3:  # noise
        t = rng.uniform(0, 1, (IMAGE_SIZE, IMAGE_SIZE)) * rng.uniform(0.2, 0.6)
    elif kind == 4:  # blotches
        t = np.zeros((IMAGE_SIZE, IMAGE_SIZE))
        for _ in range(int(rng.integers(3, 9))):
            bx, by, br = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.25)
            t = np.maximum(t, np.exp(-(((xs - bx) ** 2 + (ys - by) ** 2) / (2 * br * br))))
    elif kind == 5:  # stripes
        a, period = rng.uniform(0, math.pi), rng.uniform(4, 16)
        u = (xs * math.cos(a) + ys * math.sin(a)) * IMAGE_SIZE
        t = 0.5 + 0.5 * np.sin(2 * math.pi * u / period)
        t *= rng.uniform(0.2, 0.7)
    else:  # natural texture: 1/f^a noise, a from 1.5 to 3
        t = power_noise(rng, float(rng.uniform(1.5, 3.0)))
    rgb = base[None, None, :] * (1 - t[..., None]) + other[None, None, :] * t[..., None]
    if rng.random() < 0.3:  # clutter: small faint squares and dots
        image = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(3, 10))):
            x, y = rng.uniform(0, IMAGE_SIZE, 2)
            s = rng.uniform(1, 3)
            colour = tuple(
                int(c) for c in np.clip(rgb[int(y) % IMAGE_SIZE, int(x) % IMAGE_SIZE] + rng.normal(0, 25, 3), 0, 255)
            )
            draw.rectangle((x - s, y - s, x + s, y + s), fill=colour)
        rgb = np.asarray(image, dtype=np.float64)
    return rgb


def distractors(image: Image.Image, rng: np.random.Generator) -> None:
    """Thin straight or bent lines, one px wide, at the final size."""
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(0, 4))):
        points = [tuple(rng.uniform(0, IMAGE_SIZE, 2)) for _ in range(int(rng.integers(2, 4)))]
        colour = tuple(int(c) for c in rng.uniform(0, 255, 3))
        draw.line(points, fill=colour, width=1)


def contrasting(under: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A colour whose luminance stands at least 60 apart from `under`'s."""
    target = float(under @ [0.299, 0.587, 0.114])
    for _ in range(100):
        colour = rng.uniform(0, 255, 3)
        if abs(float(colour @ [0.299, 0.587, 0.114]) - target) >= 60:
            return colour
    return np.full(3, 0.0 if target > 127 else 255.0)


def make_sample(seed: int, index: int) -> ShapeSample:
    """Sample `index` of this renderer's set with `seed`; the same pair always gives the same sample."""
    rng = np.random.default_rng([seed, index, 4])
    label = int(rng.integers(len(SHAPE_CLASSES)))
    rgb = background(rng)
    r = float(rng.uniform(*SIZE)) * IMAGE_SIZE / 2
    if SHAPE_CLASSES[label] == "ring":  # a band of at least RING_BAND px and a hole inside it
        r = max(r, RING_BAND + 6)
    margin = r + 1
    cx, cy = rng.uniform(margin, IMAGE_SIZE - margin, 2)
    mask = silhouette(label, rng, cx * SCALE, cy * SCALE, r * SCALE)
    filled = np.asarray(mask) > 127
    if SHAPE_CLASSES[label] != "ring" and rng.random() < 0.5:  # a ring is its band
        mask = outlined(mask, float(rng.uniform(*STROKE)), rng)
    alpha = np.asarray(mask.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX), dtype=np.float64)[..., None] / 255
    small = np.asarray(Image.fromarray(filled).resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)) > 0
    under = rgb[small].mean(axis=0) if small.any() else rgb.mean(axis=(0, 1))
    colour = contrasting(under, rng)
    rgb = rgb * (1 - alpha) + colour[None, None, :] * alpha
    image = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
    if rng.random() < 0.6:
        distractors(image, rng)
    if rng.random() < 0.2:
        image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.4, 1.0))))
    if rng.random() < 0.25:
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=int(rng.integers(60, 91)))
        image = Image.open(io.BytesIO(out.getvalue())).convert("RGB")
    return ShapeSample(image, label, small)
