"""Tiny deterministic models and checkpoints, and library models converted through the CLI."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from app.core.contract.description import numeric_version
from model.checkpoint import load_checkpoint, save_checkpoint
from model.convert.__main__ import main as convert_main
from model.preprocessing import Preprocessing
from model.shapes import SHAPE_CLASSES
from model.vit import ViT, ViTConfig

TINY = ViTConfig(image_size=32, patch_size=8, in_channels=3, num_classes=10, dim=32, depth=2, heads=2, mlp_ratio=2.0)
TINY_PREPROCESSING = Preprocessing(32, 3, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), "squash")


def tiny_model(config: ViTConfig = TINY, seed: int = 0) -> ViT:
    torch.manual_seed(seed)
    return ViT(config).eval()


def write_tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    """A small random-weight checkpoint with the shapes class names (fast to load and run); each seed its own version."""
    save_checkpoint(
        path, tiny_model(seed=seed), list(SHAPE_CLASSES), TINY_PREPROCESSING, {"dataset": "shapes", "seed": seed}
    )
    return path


def heavy_checkpoint(path: Path) -> Path:
    """Random weights, big enough that one CPU thread is the bottleneck (tens of images per second): with
    VIT_THREADS=1 a forward pass outlasts the handling of a request, so concurrent requests queue."""
    torch.manual_seed(0)
    config = ViTConfig(image_size=64, patch_size=4, dim=128, depth=6, heads=4)
    p = Preprocessing(64, 3, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    save_checkpoint(path, ViT(config), list(SHAPE_CLASSES), p)
    return path


def replace_checkpoint(path: Path, seed: int) -> str:
    """Replace the file at `path` at once (written beside it, then renamed over it), as a deployment does;
    returns the new version."""
    staged = write_tiny_checkpoint(path.with_name(f".{path.name}.{seed}.tmp"), seed)
    staged.replace(path)
    return numeric_version(load_checkpoint(path).content_hash)


def write_broken_checkpoints(folder: Path) -> dict[str, str]:
    """Files in a model repository that fail to load, each its own way: {model name: what the reason says}."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    (folder / "corrupt.safetensors").write_bytes(b"not a safetensors file")
    save_file({"w": torch.zeros(2)}, str(folder / "foreign.safetensors"))  # safetensors, not a checkpoint of ours
    good = write_tiny_checkpoint(folder / ".good.tmp")
    with safe_open(str(good), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118
    good.unlink()

    def with_config(name: str, **changes: object) -> None:
        config = json.loads(metadata["config"]) | changes
        save_file(tensors, str(folder / f"{name}.safetensors"), metadata=metadata | {"config": json.dumps(config)})

    with_config("refused", pool="weird")  # an architecture our ViT does not build
    with_config("huge", dim=2**20, heads=1)  # its blocks need terabytes: the allocation fails
    return {
        "corrupt": "not a readable safetensors file",
        "foreign": "not a checkpoint of this project",
        "refused": "invalid metadata",
        "huge": "can't allocate memory",
    }


@dataclass
class Pretrained:
    """A library's model at random init, converted through the CLI, with the library's own eval pipeline.

    The model is seeded, so a process that finds the converted file already written (by another pytest-xdist
    worker of the same run) builds the same model and skips the conversion."""

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
    out = folder / "timm-vit.safetensors"
    if out.exists():  # converted by another worker of this run, from the same seeded model
        return Pretrained(out, m, create_transform(**resolve_data_config(model=m)), [])
    save_file(m.state_dict(), str(folder / "timm.safetensors"))
    convert_main(
        [
            "timm",
            "--arch",
            "vit_tiny_patch16_224",
            "--weights",
            str(folder / "timm.safetensors"),
            "--output",
            str(folder / "timm-vit.safetensors"),
        ]
    )
    return Pretrained(out, m, create_transform(**resolve_data_config(model=m)), [])


def pretrained_torchvision(folder: Path) -> Pretrained:
    import torchvision

    torch.manual_seed(0)  # ViT-B/32: the same modules as ViT-B/16's, with a quarter of its tokens to compute
    m = torchvision.models.vit_b_32(weights=None).eval()
    sharpen_head(m.heads.head, 1)
    weights = torchvision.models.ViT_B_32_Weights.IMAGENET1K_V1
    out = folder / "torchvision-vit.safetensors"
    if out.exists():
        return Pretrained(out, m, weights.transforms(), list(weights.meta["categories"]))
    torch.save(m.state_dict(), folder / "vit_b_32.pth")
    convert_main(
        [
            "torchvision",
            "--arch",
            "vit_b_32",
            "--weights",
            str(folder / "vit_b_32.pth"),
            "--output",
            str(folder / "torchvision-vit.safetensors"),
        ]
    )
    return Pretrained(out, m, weights.transforms(), list(weights.meta["categories"]))


def pretrained_hf(folder: Path) -> Pretrained:
    from transformers import ViTConfig as HFConfig
    from transformers import ViTForImageClassification, ViTImageProcessor

    labels = ["cat", "dog", "fox", "owl", "yak"]
    config = HFConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=224,
        patch_size=16,
        num_labels=5,
        id2label=dict(enumerate(labels)),
        label2id={c: i for i, c in enumerate(labels)},
    )
    torch.manual_seed(0)
    m = ViTForImageClassification(config).eval()
    sharpen_head(m.classifier, 2)
    processor = ViTImageProcessor(resample=3)  # bicubic, 224 x 224, mean and std 0.5
    out = folder / "hf-vit.safetensors"
    if not out.exists():
        m.save_pretrained(folder / "hf-vit")
        processor.save_pretrained(folder / "hf-vit")
        convert_main(["hf", "--model-dir", str(folder / "hf-vit"), "--output", str(out)])

    def transform(image: Image.Image) -> torch.Tensor:
        pixels: torch.Tensor = processor(images=image, return_tensors="pt")["pixel_values"][0]
        return pixels

    return Pretrained(out, lambda x: m(pixel_values=x).logits, transform, labels)
