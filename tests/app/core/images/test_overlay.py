from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from app.core.images.overlay import OVERLAY_MAX_SIDE, overlay_png


def test_the_map_is_drawn_red_where_it_is_high() -> None:
    image = Image.new("RGB", (600, 300), (0, 0, 255))
    grid = torch.zeros(4, 4)
    grid[:, :2] = 1.0  # the left half
    out = Image.open(io.BytesIO(overlay_png(image, grid)))
    assert out.format == "PNG" and out.size == (OVERLAY_MAX_SIDE, OVERLAY_MAX_SIDE // 2)
    pixels = np.asarray(out.convert("RGB"), dtype=int)
    left, right = pixels[:, 10], pixels[:, -10]
    assert (left[:, 0] > 100).all() and (right == [0, 0, 255]).all()


def test_small_images_keep_their_size_and_grayscale_works() -> None:
    out = Image.open(io.BytesIO(overlay_png(Image.new("L", (40, 30), 128), torch.rand(8, 8))))
    assert out.size == (40, 30) and out.mode == "RGB"
