"""The preprocessing contract reproduces each library's own evaluation transform."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as TF
from torchvision.transforms.v2.functional import _geometry as tv_geometry

from model import preprocessing
from model.checkpoint import load_checkpoint
from model.preprocessing import EvalTransform, Preprocessing, luminance, resize_and_crop
from tests.support.checkpoints import Pretrained

PIXEL_ATOL = 1e-5  # the pipelines agree up to float rounding (measured: 1.2e-07 to 7.2e-07)


@pytest.mark.parametrize(
    "source",
    ["timm", pytest.param("torchvision", marks=pytest.mark.slow), "hf"],  # torchvision's: a ViT-B/16 built
)
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


def torchvision_eval_transform(p: Preprocessing, image: Image.Image | torch.Tensor) -> torch.Tensor:
    """What `EvalTransform` computes, written with torchvision's functional ops."""
    mode = InterpolationMode(p.interpolation)
    if p.resize_backend == "pil" and isinstance(image, torch.Tensor):
        image = TF.to_pil_image(image)
    elif p.resize_backend == "tensor" and isinstance(image, Image.Image):
        image = TF.pil_to_tensor(image)
    channels = len(image.getbands()) if isinstance(image, Image.Image) else image.shape[-3]
    if p.channels == 1 and channels == 3:
        image = TF.rgb_to_grayscale(image, num_output_channels=1)
    elif p.channels == 3 and channels == 1:
        image = TF.grayscale_to_rgb(image)
    size = p.resize_size
    image = TF.resize(image, [size, size] if p.resize == "squash" else size, interpolation=mode, antialias=True)
    if size != p.image_size or p.resize == "center_crop":
        image = TF.center_crop(image, [p.image_size, p.image_size])
    x = TF.to_dtype(TF.pil_to_tensor(image) if isinstance(image, Image.Image) else image, torch.float32, scale=True)
    return TF.normalize(x, list(p.mean), list(p.std))


@pytest.mark.parametrize("resize_backend", ["tensor", "pil"])
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("resize", ["squash", "center_crop"])
def test_eval_transform_computes_what_torchvisions_ops_compute(
    photo: Image.Image, resize: str, interpolation: str, resize_backend: str
) -> None:
    """Bit for bit, over upscaling and downscaling, odd sizes, crops, grayscale and RGB, PIL and tensor input."""
    images: list[Image.Image | torch.Tensor] = [
        photo,  # 317 x 203
        photo.resize((31, 47)),
        photo.convert("L"),
        photo.crop((0, 0, 200, 200)),
        TF.pil_to_tensor(photo.resize((64, 41))),  # a decoded tensor: channels last in memory
        TF.pil_to_tensor(photo.resize((50, 90))).contiguous(),
        TF.pil_to_tensor(photo.convert("L").resize((90, 50))),
    ]
    for image_size, crop_pct in [(32, 1.0), (24, 0.875), (224, 0.9), (57, 0.95)]:
        for channels in (1, 3):
            mean, std = (0.5,) * channels, (0.25,) * channels
            p = Preprocessing(image_size, channels, mean, std, resize, crop_pct, interpolation, resize_backend)  # type: ignore[arg-type]
            for image in images:
                expected = torchvision_eval_transform(p, image)
                got = EvalTransform(p)(image)
                assert got.shape == expected.shape == (channels, image_size, image_size)
                torch.testing.assert_close(got, expected, atol=0, rtol=0, msg=f"{p} on {type(image).__name__}")


@pytest.mark.parametrize("native_uint8", [True, False])
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_a_batch_resizes_as_torchvision_resizes_it(
    photo: Image.Image, interpolation: str, native_uint8: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU decoder's path: a stack of uint8 images, resized natively or through float32 (on a GPU, and on
    CPUs without a uint8 kernel), and luminance in float rounded back to uint8."""
    if not native_uint8:
        monkeypatch.setattr(preprocessing, "native_uint8_resize", lambda interpolation: False)
        monkeypatch.setattr(tv_geometry, "_do_native_uint8_resize_on_cpu", lambda interpolation: False)
    batch = torch.stack([TF.pil_to_tensor(photo), TF.pil_to_tensor(photo.rotate(180))])
    p = Preprocessing(48, 3, (0.5,) * 3, (0.25,) * 3, "center_crop", 0.875, interpolation)  # type: ignore[arg-type]
    mode = InterpolationMode(interpolation)
    expected = TF.center_crop(TF.resize(batch, p.resize_size, interpolation=mode, antialias=True), [48, 48])
    torch.testing.assert_close(resize_and_crop(batch, p), expected, atol=0, rtol=0)
    as_float = batch.float()
    expected = TF.center_crop(TF.resize(as_float, p.resize_size, interpolation=mode, antialias=True), [48, 48])
    torch.testing.assert_close(resize_and_crop(as_float, p), expected, atol=0, rtol=0)
    torch.testing.assert_close(luminance(as_float), TF.rgb_to_grayscale(as_float), atol=0, rtol=0)


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
