"""The preprocessing contract: how a raw image becomes model input, shared by training, evaluation and serving.

A checkpoint records a `Preprocessing`; `EvalTransform` applies it. It reproduces the evaluation
transforms of the libraries a checkpoint can come from:

- timm (`create_transform(**resolve_data_config(...))`) and torchvision (`weights.transforms()`)
  resize the PIL image: shorter side to floor(image_size / crop_pct), then a centre crop
  (`resize="center_crop"`, `resize_backend="pil"`);
- Hugging Face's `ViTImageProcessor` (transformers 5) resizes a uint8 tensor with antialiasing to
  image_size x image_size (`resize="squash"`, `resize_backend="tensor"`), which is also what
  checkpoints trained here have always used; its processors that crop (CLIP's) put an odd margin's extra
  pixel after the crop (`crop_offset="floor"`), where torchvision rounds half to even.

The resizing, cropping and colour conversions are torchvision's (`transforms.v2.functional`), computed
the same way on the same kernels (`torch.nn.functional.interpolate`, PIL's `resize`; a test compares them
with torchvision's own), so that serving imports neither torchvision nor the torch.compile stack it loads
(1.5 s of CPU at every process start). This module imports no dataset code either.
"""

from __future__ import annotations

import functools
import math
import platform
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.nn import functional as F

ResizePolicy = Literal["squash", "center_crop"]
ResizeBackend = Literal["tensor", "pil"]
Interpolation = Literal["bilinear", "bicubic"]
CropOffset = Literal["round", "floor"]

PIL_RESAMPLING: dict[str, Image.Resampling] = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
}
LUMINANCE = (0.2989, 0.587, 0.114)  # ITU-R 601-2 weights of R, G and B, as torchvision and PIL use them


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
    # the centre crop's first row and column, (H - S) / 2: rounded half to even (torchvision, timm) or floored
    # (transformers' image processors); they differ where that margin is odd by one pixel
    crop_offset: CropOffset = "round"

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
        if self.crop_offset not in get_args(CropOffset):
            raise ValueError(f"crop_offset must be one of {get_args(CropOffset)}, got {self.crop_offset!r}")

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
            crop_offset=d.get("crop_offset", "round"),
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
            self.crop_offset,
        )


def resize_and_crop(image: Any, p: Preprocessing) -> Any:
    """Resize (PIL image or (..., C, H, W) tensor) per the policy, then centre-crop to image_size."""
    size = p.resize_size
    image = resize(image, (size, size) if p.resize == "squash" else size, p.interpolation)
    if size != p.image_size or p.resize == "center_crop":
        image = center_crop(image, p.image_size, p.crop_offset)
    return image


class EvalTransform:
    """PIL image or uint8 (C, H, W) tensor -> normalised (channels, S, S) float32, as `Preprocessing` says."""

    def __init__(self, p: Preprocessing) -> None:
        self.preprocessing = p

    def __call__(self, image: Image.Image | Tensor) -> Tensor:
        return self.scaled(self.pixels(image))

    def pixels(self, image: Image.Image | Tensor) -> Tensor:
        """The first half: channels, resize and crop -> (channels, S, S) uint8, every value the model will see."""
        p = self.preprocessing
        if p.resize_backend == "pil":
            if isinstance(image, Tensor):
                image = to_pil(image)
            return as_tensor(resize_and_crop(to_channels(image, p.channels), p))
        x: Tensor = resize_and_crop(to_channels(as_tensor(image), p.channels), p)
        return x

    def scaled(self, x: Tensor) -> Tensor:
        """The second half: (..., C, S, S) uint8 -> float32 scaled to [0, 1] and normalised, on x's device."""
        p = self.preprocessing
        return normalize(to_float(x), p.mean, p.std)

    def __repr__(self) -> str:
        return f"EvalTransform({self.preprocessing})"


def resized_size(height: int, width: int, size: int | tuple[int, int]) -> tuple[int, int]:
    """The (height, width) a resize to `size` gives: a pair sets both sides; an int sets the shorter side,
    the longer one scaled in proportion and truncated (torchvision's rule)."""
    if isinstance(size, tuple):
        return size
    if width <= height:
        return int(size * height / width), size
    return size, int(size * width / height)


def resize(image: Any, size: int | tuple[int, int], interpolation: Interpolation) -> Any:
    """Antialiased resize of a PIL image or a (..., C, H, W) uint8 or float tensor, as torchvision's
    `resize(image, size, interpolation, antialias=True)`."""
    if isinstance(image, Image.Image):
        height, width = resized_size(image.height, image.width, size)
        if (height, width) == (image.height, image.width):
            return image
        return image.resize((width, height), resample=PIL_RESAMPLING[interpolation])
    shape = image.shape
    channels, old_height, old_width = shape[-3:]
    height, width = resized_size(old_height, old_width, size)
    if (height, width) == (old_height, old_width) or image.numel() == 0:
        return image
    dtype = image.dtype
    # uint8 is resized natively where torch has a kernel for it (bicubic on the CPU; bilinear on CPUs with
    # AVX2 or NEON), and through float32, rounded back, elsewhere: torchvision chooses the same way.
    native = dtype == torch.uint8 and image.device.type == "cpu" and native_uint8_resize(interpolation)
    cast = not native and not dtype.is_floating_point
    x = image.reshape(-1, channels, old_height, old_width)
    x = F.interpolate(
        x.float() if cast else x, size=[height, width], mode=interpolation, align_corners=False, antialias=True
    )
    if cast:
        if interpolation == "bicubic":
            x = x.clamp_(0, 255)
        x = x.round_().to(dtype)
    return x.reshape(*shape[:-3], channels, height, width)


@functools.cache  # the CPU does not change: decided once per interpolation, not per image
def native_uint8_resize(interpolation: Interpolation) -> bool:
    if interpolation == "bilinear":
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in (
            "aarch64",
            "arm64",
        )
    return True


def center_crop(image: Any, size: int, offset: CropOffset = "round") -> Any:
    """The central size x size window (of an image at least that large), as torchvision's `center_crop` (offset
    "round") or transformers' (offset "floor")."""
    height, width = (image.height, image.width) if isinstance(image, Image.Image) else image.shape[-2:]
    if size > height or size > width:
        raise ValueError(f"cannot centre-crop {size}x{size} out of a {width}x{height} image")
    if offset == "floor":
        top, left = (height - size) // 2, (width - size) // 2
    else:
        top, left = round((height - size) / 2.0), round((width - size) / 2.0)
    if isinstance(image, Image.Image):
        return image.crop((left, top, left + size, top + size))
    return image[..., top : top + size, left : left + size]


def to_float(x: Tensor) -> Tensor:
    """uint8 [0, 255] -> float32 [0, 1] (torchvision's `to_dtype(x, torch.float32, scale=True)`)."""
    return x.to(torch.float32).mul_(1.0 / 255)


def normalize(x: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """(x - mean) / std per channel of a (..., C, H, W) float tensor."""
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return x.sub(m).div_(s)


def luminance(rgb: Tensor) -> Tensor:
    """(..., 3, H, W) -> (..., 1, H, W) in the input's dtype (truncated for integers), as torchvision's
    `rgb_to_grayscale`."""
    r, g, b = rgb.unbind(dim=-3)
    return r.mul(LUMINANCE[0]).add_(g, alpha=LUMINANCE[1]).add_(b, alpha=LUMINANCE[2]).unsqueeze(-3).to(rgb.dtype)


def as_tensor(image: Image.Image | Tensor) -> Tensor:
    """A PIL image's pixels as a (C, H, W) uint8 tensor (a view of an (H, W, C) array, as torchvision's)."""
    if isinstance(image, Tensor):
        return image
    pixels = torch.as_tensor(np.array(image, copy=True))
    return pixels.view(image.height, image.width, len(image.getbands())).permute(2, 0, 1)


def to_pil(x: Tensor) -> Image.Image:
    """A (C, H, W) uint8 tensor, 1 or 3 channels, as a PIL image ("L" or "RGB")."""
    pixels = x.permute(1, 2, 0).numpy()
    return Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)


def to_channels(image: Any, channels: int) -> Any:
    """Grayscale models take luminance (ITU-R 601-2) of RGB input; matching input passes unchanged."""
    if channels == 1:
        if num_channels(image) != 3:
            return image
        return image.convert("L") if isinstance(image, Image.Image) else luminance(image)
    if num_channels(image) == 1:
        return image.convert("RGB") if isinstance(image, Image.Image) else image.repeat_interleave(3, dim=-3)
    return image


def num_channels(image: Image.Image | Tensor) -> int:
    if isinstance(image, Tensor):
        return int(image.shape[-3])
    return len(image.getbands())
