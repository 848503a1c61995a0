"""The preprocessing contract: how a raw image becomes model input, shared by training, evaluation and serving.

A checkpoint records a `Preprocessing`; `EvalTransform` applies it. It reproduces the evaluation
transforms of the libraries a checkpoint can come from:

- timm (`create_transform(**resolve_data_config(...))`) and torchvision (`weights.transforms()`)
  resize the PIL image: shorter side to floor(image_size / crop_pct), then a centre crop
  (`resize="center_crop"`, `resize_backend="pil"`);
- Hugging Face's `ViTImageProcessor` (transformers 5) resizes a uint8 tensor with antialiasing to
  image_size x image_size (`resize="squash"`, `resize_backend="tensor"`), which is also what
  checkpoints trained here have always used.

This module imports no dataset code, so the service can use it without pulling in training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from PIL import Image
from torch import Tensor
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

ResizePolicy = Literal["squash", "center_crop"]
ResizeBackend = Literal["tensor", "pil"]
Interpolation = Literal["bilinear", "bicubic"]

INTERPOLATION_MODES: dict[str, InterpolationMode] = {
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
}


@dataclass(frozen=True)
class Preprocessing:
    """How raw images become model input; the service applies exactly this."""

    image_size: int
    channels: int  # 1 or 3
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize: ResizePolicy = "squash"  # squash: resize both sides; center_crop: shorter side, then crop
    crop_pct: float = 1.0  # resize to floor(image_size / crop_pct) first, then centre-crop image_size
    interpolation: Interpolation = "bilinear"
    resize_backend: ResizeBackend = "tensor"  # resize a uint8 tensor (antialiased) or the PIL image

    def __post_init__(self) -> None:
        if self.image_size < 1:
            raise ValueError(f"image_size must be positive, got {self.image_size}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"mean and std need {self.channels} values each, got {self.mean} and {self.std}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std values must be positive, got {self.std}")
        if self.resize not in get_args(ResizePolicy):
            raise ValueError(f"resize must be one of {get_args(ResizePolicy)}, got {self.resize!r}")
        if not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        if self.interpolation not in get_args(Interpolation):
            raise ValueError(f"interpolation must be one of {get_args(Interpolation)}, got {self.interpolation!r}")
        if self.resize_backend not in get_args(ResizeBackend):
            raise ValueError(f"resize_backend must be one of {get_args(ResizeBackend)}, got {self.resize_backend!r}")

    @property
    def resize_size(self) -> int:
        """Side the image is resized to before the centre crop (timm's floor(size / crop_pct))."""
        # The epsilon keeps exact ratios exact: 224 / (224 / 256) must give 256, not 255.
        return math.floor(self.image_size / self.crop_pct + 1e-6)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Preprocessing:
        """Read a checkpoint's record; fields added later default to what older checkpoints did."""
        return cls(
            image_size=int(d["image_size"]),
            channels=int(d["channels"]),
            mean=tuple(float(x) for x in d["mean"]),
            std=tuple(float(x) for x in d["std"]),
            resize=d.get("resize", "squash"),
            crop_pct=float(d.get("crop_pct", 1.0)),
            interpolation=d.get("interpolation", "bilinear"),
            resize_backend=d.get("resize_backend", "tensor"),
        )

    def with_image_size(self, image_size: int) -> Preprocessing:
        """The same recipe at another input size (fine-tuning at a new resolution keeps crop_pct)."""
        return Preprocessing(
            image_size,
            self.channels,
            self.mean,
            self.std,
            self.resize,
            self.crop_pct,
            self.interpolation,
            self.resize_backend,
        )


def resize_and_crop(image: Any, p: Preprocessing) -> Any:
    """Resize (PIL image or (C, H, W) tensor) per the policy, then centre-crop to image_size."""
    mode = INTERPOLATION_MODES[p.interpolation]
    size = p.resize_size
    if p.resize == "squash":
        image = TF.resize(image, [size, size], interpolation=mode, antialias=True)
    else:  # shorter side to `size`, aspect ratio kept
        image = TF.resize(image, size, interpolation=mode, antialias=True)
    if size != p.image_size or p.resize == "center_crop":
        image = TF.center_crop(image, [p.image_size, p.image_size])
    return image


class EvalTransform:
    """PIL image or uint8 (C, H, W) tensor -> normalised (channels, S, S) float32, as `Preprocessing` says."""

    def __init__(self, p: Preprocessing) -> None:
        self.preprocessing = p

    def __call__(self, image: Image.Image | Tensor) -> Tensor:
        p = self.preprocessing
        if p.resize_backend == "pil":
            if isinstance(image, Tensor):
                image = TF.to_pil_image(image)
            image = resize_and_crop(to_channels(image, p.channels), p)
            x = TF.pil_to_tensor(image)  # (C, S, S) uint8
        else:
            x = resize_and_crop(to_channels(as_tensor(image), p.channels), p)
        x = TF.to_dtype(x, torch.float32, scale=True)
        return TF.normalize(x, list(p.mean), list(p.std))

    def __repr__(self) -> str:
        return f"EvalTransform({self.preprocessing})"


def as_tensor(image: Image.Image | Tensor) -> Tensor:
    return image if isinstance(image, Tensor) else TF.pil_to_tensor(image)


def to_channels(image: Any, channels: int) -> Any:
    """Grayscale models take luminance (ITU-R 601-2) of RGB input; matching input passes unchanged."""
    if channels == 1:
        return TF.rgb_to_grayscale(image, num_output_channels=1) if num_channels(image) == 3 else image
    if num_channels(image) == 1:
        return TF.grayscale_to_rgb(image) if isinstance(image, Tensor) else image.convert("RGB")
    return image


def num_channels(image: Image.Image | Tensor) -> int:
    if isinstance(image, Tensor):
        return int(image.shape[-3])
    return len(image.getbands())
