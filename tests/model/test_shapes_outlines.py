"""The outline set: small circles at the spec's thickest outlines and rings of their sizes, deterministic, each a
band of the width it says; and the bundled model read through it by `python -m model.evaluate --renderer outlines`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from app.settings import BUNDLED_WEIGHTS
from harness.preloaded import run_command
from model.shapes import IMAGE_SIZE, SHAPE_CLASSES, render_dataset
from model.shapes_outlines import make_sample
from tests.model.test_shapes import ring_band


def test_deterministic_half_circles_half_rings() -> None:
    a, b = make_sample(3, 4), make_sample(3, 4)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    images, labels, masks = render_dataset(40, 5, make_sample)
    assert images.shape == (40, IMAGE_SIZE, IMAGE_SIZE, 3)
    assert labels.tolist() == [SHAPE_CLASSES.index("circle"), SHAPE_CLASSES.index("ring")] * 20
    extents = [np.ptp(np.nonzero(m)[0]) + 1 for m in masks]
    assert min(extents) >= 0.33 * IMAGE_SIZE and max(extents) <= 0.6 * IMAGE_SIZE  # small: 35 to 50 % of the side


def test_rings_are_wider_bands_than_any_outline() -> None:
    rings = [make_sample(7, i) for i in range(1, 80, 2)]
    assert min(ring_band(s.mask) for s in rings) > 6 + 1  # the thickest outline, and a pixel's margin to measure


@pytest.mark.slow  # the command line, as a process of its own
def test_evaluate_reads_the_bundled_model_through_the_outline_set(tmp_path: Path) -> None:
    out = tmp_path / "outlines.json"
    argv = ["--checkpoint", str(BUNDLED_WEIGHTS), "--renderer", "outlines", "--samples", "200", "--json", str(out)]
    done = run_command([sys.executable, "-m", "model.evaluate", *argv], timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["dataset"] == "shapes, outlines renderer" and result["accuracy"] > 0.95  # 99.3 % on 1,000
