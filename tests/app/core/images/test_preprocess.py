from __future__ import annotations

import torch
from PIL import Image

from app.core.images.prepare import Preprocessor
from model.preprocessing import EvalTransform, Preprocessing


def test_the_checkpoints_evaluation_transform(photo: Image.Image) -> None:
    p = Preprocessing(48, 3, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), "center_crop", crop_pct=0.875, interpolation="bicubic")
    x = Preprocessor(p)(photo)
    assert x.shape == (3, 48, 48) and x.dtype == torch.float32
    torch.testing.assert_close(x, EvalTransform(p)(photo), rtol=0, atol=0)


def test_grayscale_models_get_one_channel(photo: Image.Image) -> None:
    x = Preprocessor(Preprocessing(32, 1, (0.5,), (0.5,)))(photo)
    assert x.shape == (1, 32, 32)
    assert x.min() >= -1.0 and x.max() <= 1.0
