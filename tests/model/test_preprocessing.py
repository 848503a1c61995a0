"""The preprocessing contract reproduces each library's own evaluation transform."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from model.checkpoint import load_checkpoint
from model.preprocessing import EvalTransform, Preprocessing
from tests.support.checkpoints import Pretrained

PIXEL_ATOL = 1e-5  # the pipelines agree up to float rounding (measured: 1.2e-07 to 7.2e-07)


@pytest.mark.parametrize("source", ["timm", "torchvision", "hf"])
def test_eval_transform_equals_the_library_pipeline(
    pretrained: Callable[[str], Pretrained], photo: Image.Image, source: str
) -> None:
    ref = pretrained(source)
    ours = EvalTransform(load_checkpoint(ref.checkpoint).preprocessing)(photo)
    theirs = ref.transform(photo)
    assert ours.shape == theirs.shape == (3, 224, 224)
    torch.testing.assert_close(ours, theirs, atol=PIXEL_ATOL, rtol=0)


def test_torchvision_recipes_of_other_sizes(photo: Image.Image) -> None:
    from torchvision.models import get_model_weights

    from model.convert.torchvision_vit import torchvision_preprocessing
    from model.vit import ViTConfig

    for weights in get_model_weights("vit_l_16"):
        crop = weights.transforms().crop_size[0]
        ours = EvalTransform(torchvision_preprocessing(weights, ViTConfig(image_size=crop, patch_size=16)))(photo)
        torch.testing.assert_close(ours, weights.transforms()(photo), atol=PIXEL_ATOL, rtol=0)


def test_old_records_load_with_the_old_behaviour(photo: Image.Image) -> None:
    """Checkpoints written before crop_pct, interpolation and resize_backend existed resize as before."""
    old = {"image_size": 32, "channels": 3, "mean": [0.5] * 3, "std": [0.25] * 3, "resize": "squash"}
    p = Preprocessing.from_dict(old)
    assert (p.crop_pct, p.interpolation, p.resize_backend) == (1.0, "bilinear", "tensor")
    before = v2.Compose(
        [
            v2.ToImage(),
            v2.Resize((32, 32), antialias=True),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.5] * 3, [0.25] * 3),
        ]
    )
    torch.testing.assert_close(EvalTransform(p)(photo), before(photo), atol=0, rtol=0)


def test_resize_size_keeps_exact_ratios() -> None:
    assert Preprocessing(224, 3, (0.5,) * 3, (0.5,) * 3, "center_crop", 224 / 256).resize_size == 256
    assert Preprocessing(224, 3, (0.5,) * 3, (0.5,) * 3, "center_crop", 0.9).resize_size == 248  # timm's floor
    assert Preprocessing(384, 3, (0.5,) * 3, (0.5,) * 3, "center_crop", 1.0).resize_size == 384


def test_grayscale_and_rgb_inputs_meet_the_model(photo: Image.Image) -> None:
    gray = Preprocessing(32, 1, (0.5,), (0.2,), resize_backend="pil")
    assert EvalTransform(gray)(photo).shape == (1, 32, 32)
    rgb = Preprocessing(32, 3, (0.5,) * 3, (0.2,) * 3, resize_backend="pil")
    assert EvalTransform(rgb)(photo.convert("L")).shape == (3, 32, 32)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"crop_pct": 0.0}, "crop_pct must be in"),
        ({"interpolation": "lanczos"}, "interpolation must be one of"),
        ({"resize_backend": "cv2"}, "resize_backend must be one of"),
    ],
)
def test_invalid_records_are_refused(changes: dict[str, object], message: str) -> None:
    base = {"image_size": 32, "channels": 1, "mean": (0.5,), "std": (0.5,)}
    with pytest.raises(ValueError, match=message):
        Preprocessing(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.slow  # a fresh interpreter
def test_the_contract_imports_no_training_code() -> None:
    code = "import sys, model.preprocessing; print(sorted(m for m in sys.modules if m.startswith('model')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['model', 'model.preprocessing']"
