"""Shared fixtures: tiny deterministic models and checkpoints, generated images."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from model.checkpoint import save_checkpoint
from model.convert.__main__ import main as convert_main
from model.preprocessing import Preprocessing
from model.shapes import SHAPE_CLASSES, make_sample
from model.vit import ViT, ViTConfig

TINY = ViTConfig(image_size=32, patch_size=8, in_channels=3, num_classes=10, dim=32, depth=2, heads=2, mlp_ratio=2.0)
TINY_PREPROCESSING = Preprocessing(32, 3, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), "squash")


def tiny_model(config: ViTConfig = TINY, seed: int = 0) -> ViT:
    torch.manual_seed(seed)
    return ViT(config).eval()


def write_tiny_checkpoint(path: Path) -> Path:
    """A small random-weight checkpoint with the shapes class names (fast to load and run)."""
    save_checkpoint(path, tiny_model(), list(SHAPE_CLASSES), TINY_PREPROCESSING, {"dataset": "shapes", "seed": 0})
    return path


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    return write_tiny_checkpoint(tmp_path / "tiny.safetensors")


def encode(image: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture
def shape_png() -> bytes:
    return encode(make_sample(123, 0).image)


@pytest.fixture(scope="session")
def photo() -> Image.Image:
    """A non-square RGB image with gradients and noise, so resizing and cropping are not trivial."""
    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:203, 0:317]
    channels = [(xs * 0.8) % 256, (ys * 1.2) % 256, ((xs + ys) * 0.5) % 256]
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 20, (203, 317, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


@dataclass
class Pretrained:
    """A library's model at random init, converted through the CLI, with the library's own eval pipeline."""

    checkpoint: Path
    model: Callable[[torch.Tensor], torch.Tensor]  # library model: pixels -> logits
    transform: Callable[[Image.Image], torch.Tensor]  # library's evaluation transform
    classes: list[str]


def sharpen_head(head: torch.nn.Linear, seed: int) -> None:
    """Random heads give near-uniform probabilities; a larger head makes equality checks meaningful."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.5)


def pretrained_timm(folder: Path) -> Pretrained:
    import timm
    from safetensors.torch import save_file
    from timm.data import create_transform, resolve_data_config

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
    sharpen_head(m.head, 0)
    save_file(m.state_dict(), str(folder / "timm.safetensors"))
    out = convert_main(["timm", "--arch", "vit_tiny_patch16_224", "--weights", str(folder / "timm.safetensors"),
                        "--output", str(folder / "timm-vit.safetensors")])  # fmt: skip
    return Pretrained(out, m, create_transform(**resolve_data_config(model=m)), [])


def pretrained_torchvision(folder: Path) -> Pretrained:
    import torchvision

    torch.manual_seed(0)
    m = torchvision.models.vit_b_16(weights=None).eval()
    sharpen_head(m.heads.head, 1)
    torch.save(m.state_dict(), folder / "vit_b_16.pth")
    out = convert_main(["torchvision", "--arch", "vit_b_16", "--weights", str(folder / "vit_b_16.pth"),
                        "--output", str(folder / "torchvision-vit.safetensors")])  # fmt: skip
    weights = torchvision.models.ViT_B_16_Weights.IMAGENET1K_V1
    return Pretrained(out, m, weights.transforms(), list(weights.meta["categories"]))


def pretrained_hf(folder: Path) -> Pretrained:
    from transformers import ViTConfig as HFConfig
    from transformers import ViTForImageClassification, ViTImageProcessor

    labels = ["cat", "dog", "fox", "owl", "yak"]
    config = HFConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=224,
        patch_size=16, num_labels=5, id2label=dict(enumerate(labels)), label2id={c: i for i, c in enumerate(labels)},
    )  # fmt: skip
    torch.manual_seed(0)
    m = ViTForImageClassification(config).eval()
    sharpen_head(m.classifier, 2)
    m.save_pretrained(folder / "hf-vit")
    processor = ViTImageProcessor(resample=3)  # bicubic, 224 x 224, mean and std 0.5
    processor.save_pretrained(folder / "hf-vit")
    out = convert_main(["hf", "--model-dir", str(folder / "hf-vit"), "--output", str(folder / "hf-vit.safetensors")])

    def transform(image: Image.Image) -> torch.Tensor:
        pixels: torch.Tensor = processor(images=image, return_tensors="pt")["pixel_values"][0]
        return pixels

    return Pretrained(out, lambda x: m(pixel_values=x).logits, transform, labels)


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Pretrained]:
    """`pretrained("timm" | "torchvision" | "hf")`: converted once per test session."""
    made: dict[str, Pretrained] = {}
    builders = {"timm": pretrained_timm, "torchvision": pretrained_torchvision, "hf": pretrained_hf}

    def get(source: str) -> Pretrained:
        if source not in made:
            made[source] = builders[source](tmp_path_factory.mktemp(source))
        return made[source]

    return get
