"""The benchmark's ViT-S/16 (timm's vit_small_patch16_224 shape) at random weights, for speed measurements only."""

from __future__ import annotations

from pathlib import Path

import torch

from model.checkpoint import save_checkpoint
from model.preprocessing import Preprocessing
from model.vit import ViT, ViTConfig

VIT_S16 = ViTConfig(image_size=224, patch_size=16, dim=384, depth=12, heads=6, num_classes=1000, norm_eps=1e-6)
VIT_S16_PREPROCESSING = Preprocessing(
    224, 3, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "center_crop", crop_pct=0.9, interpolation="bicubic"
)


def vit_s16_checkpoint(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    save_checkpoint(
        path,
        ViT(VIT_S16).eval(),
        [f"class_{i}" for i in range(1000)],
        VIT_S16_PREPROCESSING,
        {"note": "random weights, for speed measurements only"},
    )
    return path


def stand_in_checkpoint(path: Path, classes: int = 1000) -> Path:
    """A checkpoint of ViT-S/16's input (224 px, its preprocessing) with a tiny network: what the device stand-in
    serves, which times the forward and never runs the weights."""
    torch.manual_seed(0)
    config = ViTConfig(image_size=224, patch_size=16, dim=32, depth=1, heads=2, num_classes=classes)
    save_checkpoint(path, ViT(config).eval(), [f"class_{i}" for i in range(classes)], VIT_S16_PREPROCESSING)
    return path
