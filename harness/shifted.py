"""Images a shapes model never saw, for out-of-distribution measurements (evaluation.ood, evaluation.drift, the tests):
held-out shapes as the in-distribution reference, and shapes under heavy noise, shapes in a colour of the
background's luminance, crops of scikit-image's photographs and uniform noise; and the AUROC between two sets
of scores."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from PIL import Image

from model.evaluate import DEFAULT_SHAPES_EVAL_SEED
from model.shapes import IMAGE_SIZE, background, luminance, make_sample, random_colour, render_shape

PHOTOS = ["astronaut", "chelsea", "coffee", "rocket", "camera", "immunohistochemistry", "retina", "hubble_deep_field"]
NOISE_SIGMA = 64.0


def auroc(inside: np.ndarray, outside: np.ndarray) -> float:
    """P(an outside score > an inside score), ties counted half (the Mann-Whitney statistic)."""
    o, i = outside[:, None], inside[None, :]
    return float((o > i).mean() + 0.5 * (o == i).mean())


def held_out_shapes(i: int) -> Image.Image:
    return make_sample(DEFAULT_SHAPES_EVAL_SEED, i).image.convert("RGB")


def noisy_shapes(i: int) -> Image.Image:
    pixels = np.asarray(held_out_shapes(100_000 + i), dtype=np.float64)
    pixels = pixels + np.random.default_rng([11, i]).normal(0, NOISE_SIGMA, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def low_contrast_shapes(i: int) -> Image.Image:
    """A shape as the dataset draws it, but in a colour within 0.05 of the background's luminance."""
    rng = np.random.default_rng([13, i])
    label = int(rng.integers(10))
    bg = background(rng, IMAGE_SIZE)
    colour = random_colour(rng)
    for _ in range(1000):
        if abs(luminance(colour) - luminance(bg)) < 0.05:
            break
        colour = random_colour(rng)
    coverage, _ = render_shape(label, rng)
    alpha = np.asarray(coverage.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX), dtype=np.float64)[..., None]
    pixels = bg * (1 - alpha / 255) + colour * alpha / 255
    return Image.fromarray(np.clip(pixels + 0.5, 0, 255).astype(np.uint8))


def photograph_crops(photos: list[Image.Image]) -> Callable[[int], Image.Image]:
    def crop(i: int) -> Image.Image:
        rng = np.random.default_rng([17, i])
        photo = photos[i % len(photos)]
        side = int(min(photo.size) * rng.uniform(0.2, 1.0))
        left, top = rng.integers(0, photo.width - side + 1), rng.integers(0, photo.height - side + 1)
        return photo.crop((int(left), int(top), int(left) + side, int(top) + side))

    return crop


def uniform_noise(i: int) -> Image.Image:
    pixels = np.random.default_rng([19, i]).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def skimage_photos() -> list[Image.Image]:
    try:
        from skimage import data
    except ImportError:
        raise SystemExit("the photographs need scikit-image: .venv/bin/pip install -e '.[dev]'") from None
    return [Image.fromarray(getattr(data, name)()).convert("RGB") for name in PHOTOS]


def shifted_sets() -> dict[str, Callable[[int], Image.Image]]:
    """The shifted sets by name, each image i of a set made on demand."""
    return {
        "noisy shapes": noisy_shapes,
        "low-contrast shapes": low_contrast_shapes,
        "photographs": photograph_crops(skimage_photos()),
        "uniform noise": uniform_noise,
    }
