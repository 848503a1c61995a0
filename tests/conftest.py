"""Shared fixtures: tiny deterministic models and checkpoints, generated images."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from model.checkpoint import Preprocessing, save_checkpoint
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
