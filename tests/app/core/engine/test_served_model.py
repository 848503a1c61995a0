"""One served checkpoint: what it tells about itself, its image preparation and class targets."""

from __future__ import annotations

import pytest
import torch

from app.core.contract.errors import InvalidInput, PayloadTooLarge
from app.core.contract.request import EncodedImage
from app.core.engine.engine import Engine
from harness.images import encode
from model.shapes import SHAPE_CLASSES, make_sample


def test_what_a_model_tells_about_itself(service: Engine) -> None:
    model = service.model(None)
    assert model.name == "tiny" and model.classes == list(SHAPE_CLASSES)
    assert model.input_shape == (3, 32, 32) and model.grid_size == 4
    assert model.version == str(int(model.checkpoint.version, 16))  # the short content hash, as a number


def test_prepare_decodes_and_preprocesses_as_the_checkpoint_says(service: Engine) -> None:
    model = service.model(None)
    image = make_sample(3, 1).image
    prepared = model.preparer.prepare(EncodedImage("a.png", encode(image)), keep_image=True)
    assert prepared.filename == "a.png" and prepared.image is not None
    torch.testing.assert_close(prepared.pixels, model.preparer.preprocessor(image.convert("RGB")))
    assert model.preparer.prepare(EncodedImage("a.png", encode(image)), keep_image=False).image is None


def test_the_pixel_limit_is_checked_before_decoding(service: Engine) -> None:
    model = service.model(None)
    model.preparer.max_pixels = 100
    with pytest.raises(PayloadTooLarge, match=r"big.png: 64x64 = 4096 pixels is over the limit of 100"):
        model.preparer.prepare(EncodedImage("big.png", encode(make_sample(3, 1).image)), keep_image=False)


@pytest.mark.parametrize(("target", "index"), [(None, None), ("star", SHAPE_CLASSES.index("star")), ("0", 0), ("9", 9)])
def test_targets_by_label_or_index(service: Engine, target: str | None, index: int | None) -> None:
    assert service.model(None).target_index(target) == index


@pytest.mark.parametrize("target", ["10", "-1", "Star", ""])
def test_targets_that_name_no_class(service: Engine, target: str) -> None:
    with pytest.raises(InvalidInput, match=r"give a label or an index 0\.\.9"):
        service.model(None).target_index(target)
