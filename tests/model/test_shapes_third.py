"""The third renderer, written from the model card's spec alone: deterministic, apart from the other two, every
class within the sizes the spec gives, its colours standing out, a ring's band of 8 px at the least; and the
bundled model read through it by `python -m model.evaluate --renderer third`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from app.settings import BUNDLED_WEIGHTS
from harness.preloaded import run_command
from model import shapes_second
from model.shapes import IMAGE_SIZE, SHAPE_CLASSES, luminance, render_dataset
from model.shapes_third import RING_BAND, SCALE, make_sample, outlined
from tests.model.test_shapes import ring_band


def test_deterministic_from_seed_and_apart_from_the_other_renderers() -> None:
    a, b, c = make_sample(3, 17), make_sample(3, 17), make_sample(4, 17)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image)) and a.label == b.label
    assert not np.array_equal(np.asarray(a.image), np.asarray(c.image))
    third, _, _ = render_dataset(20, 3, make_sample)
    for other in (None, shapes_second.make_sample):
        theirs, _, _ = render_dataset(20, 3, other) if other else render_dataset(20, 3)
        assert not any(np.array_equal(x, y) for x, y in zip(third, theirs, strict=True))


@pytest.mark.slow  # hundreds of images rendered
def test_every_class_from_35_to_85_percent_of_the_side_inside_the_image() -> None:
    images, labels, masks = render_dataset(100, 5, make_sample)
    assert images.shape == (100, IMAGE_SIZE, IMAGE_SIZE, 3) and images.dtype == np.uint8
    assert set(labels.tolist()) == set(range(10))
    for m in masks:
        ys, xs = np.nonzero(m)
        extent = max(ys.max() - ys.min(), xs.max() - xs.min()) + 1
        assert IMAGE_SIZE / 4 <= extent <= 0.9 * IMAGE_SIZE  # 35 % of the side at least, less a thin shape's tip
        assert ys.min() >= 0 and xs.min() >= 0 and ys.max() <= IMAGE_SIZE - 1 and xs.max() <= IMAGE_SIZE - 1


def test_the_shape_stands_out_from_what_lies_under_it() -> None:
    """Its edge (painted, filled or outlined) against the background beside it, past an outline's outer half."""
    for i in range(40):
        s = make_sample(9, i)
        img = np.asarray(s.image, dtype=np.float64)
        inner = s.mask & np.roll(s.mask, 2, axis=0) & np.roll(s.mask, -2, axis=0)
        inner &= np.roll(s.mask, 2, axis=1) & np.roll(s.mask, -2, axis=1)
        edge = s.mask & ~inner
        near = s.mask | np.roll(s.mask, 4, axis=0)  # an outline about the edge paints up to 3 px beyond it
        beside = ~near & np.roll(s.mask, 6, axis=0)
        if edge.sum() < 30 or beside.sum() < 10:
            continue
        assert abs(luminance(img[edge]) - luminance(img[beside])) > 0.02, i


@pytest.mark.slow  # dozens of images rendered
def test_a_rings_band_is_8_px_at_the_least() -> None:
    ring = SHAPE_CLASSES.index("ring")
    drawn = [i for i in range(600) if np.random.default_rng([11, i, 4]).integers(len(SHAPE_CLASSES)) == ring]
    rings = [s for s in (make_sample(11, i) for i in drawn) if s.label == ring]
    assert len(rings) > 30
    assert min(ring_band(s.mask) for s in rings) >= RING_BAND - 1  # less a pixel of the mask's edge


@pytest.mark.parametrize("inward", [True, False])
def test_an_outline_is_as_wide_as_its_stroke_in_every_direction(inward: bool) -> None:
    """A circle outlined at 6 px: its band is 6 px across along the axes and the diagonals alike (inside the edge, or
    half of it outside), never the 8 px of a ring's narrowest band."""
    side, r, stroke = 64 * SCALE, 24 * SCALE, 6.0
    disc = Image.new("L", (side, side), 0)
    ImageDraw.Draw(disc).ellipse([side / 2 - r, side / 2 - r, side / 2 + r, side / 2 + r], fill=255)

    class Side:  # `outlined` asks its generator which side of the edge the stroke lies on
        def random(self) -> float:
            return 0.0 if inward else 1.0

    band = np.asarray(outlined(disc, stroke, Side())) > 127  # type: ignore[arg-type]
    ys, xs = np.nonzero(band)
    d = np.hypot(ys - (side - 1) / 2, xs - (side - 1) / 2) / SCALE  # px of the final image
    angle = np.degrees(np.arctan2(ys - side / 2, xs - side / 2)) % 90
    for towards in (angle < 5, (angle > 40) & (angle < 50)):  # along an axis, along a diagonal
        across = d[towards].max() - d[towards].min()
        assert stroke - 0.5 <= across <= stroke + 0.5, across
    assert d.max() == pytest.approx(24 if inward else 27, abs=0.5)


@pytest.mark.slow  # the command line, as a process of its own
def test_evaluate_reads_the_bundled_model_through_the_third_renderer(tmp_path: Path) -> None:
    out = tmp_path / "third.json"
    argv = ["--checkpoint", str(BUNDLED_WEIGHTS), "--renderer", "third", "--samples", "100", "--json", str(out)]
    done = run_command([sys.executable, "-m", "model.evaluate", *argv], timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("shapes, third renderer: 100 images, top-1 accuracy ")
    result = json.loads(out.read_text())
    assert result["dataset"] == "shapes, third renderer" and result["accuracy"] > 0.8
