"""Tiny datasets written in torchvision's own on-disk formats, so its real loaders read them."""

from __future__ import annotations

import hashlib
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision import datasets


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def write_cifar10(root: Path, monkeypatch: pytest.MonkeyPatch, per_batch: int = 20) -> None:
    """cifar-10-batches-py/ with 5 train batches, a test batch and batches.meta (pickled dicts)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        labels = [int(i % 10) for i in range(per_batch)]
        data = rng.integers(0, 256, size=(per_batch, 3 * 32 * 32), dtype=np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels, "batch_label": name.encode()}, f)
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": classes, "num_cases_per_batch": per_batch}, f)
    # torchvision verifies each file's MD5 against its list: point the lists at these files.
    monkeypatch.setattr(datasets.CIFAR10, "train_list", [[n, md5(folder / n)] for n in names[:5]])
    monkeypatch.setattr(datasets.CIFAR10, "test_list", [[names[5], md5(folder / names[5])]])
    monkeypatch.setattr(
        datasets.CIFAR10,
        "meta",
        {"filename": "batches.meta", "key": "label_names", "md5": md5(folder / "batches.meta")},
    )


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX format: magic (0, 0, type 0x08 = ubyte, ndim), big-endian dims, raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist(root: Path, n_train: int = 60, n_test: int = 30) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, size=(n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)


def write_imagefolder(root: Path, classes: tuple[str, ...] = ("cat", "dog", "fox"), per_class: int = 8) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for i, c in enumerate(classes):
            (root / split / c).mkdir(parents=True)
            for j in range(per_class if split == "train" else 3):
                pixels = rng.integers(0, 256, size=(40 + j, 50, 3), dtype=np.uint8)
                pixels[..., i] = 255  # a class cue the tiny model can pick up
                Image.fromarray(pixels).save(root / split / c / f"{j}.{'png' if j % 2 else 'jpg'}")
