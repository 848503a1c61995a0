"""Datasets for training and evaluation: cifar10, mnist, imagefolder and the procedural shapes.

Every builder returns a `DataBundle`: train and test datasets yielding (tensor, label), the class
names, and the `Preprocessing` the checkpoint records so the service normalises exactly as here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset
from torchvision import datasets
from torchvision.transforms import InterpolationMode, v2

from model.preprocessing import EvalTransform, Preprocessing
from model.shapes import IMAGE_SIZE as SHAPES_SIZE
from model.shapes import SHAPE_CLASSES, ShapeSample, make_background, make_sample, render_dataset

DATASETS: tuple[str, ...] = ("shapes", "cifar10", "mnist", "imagefolder")

# Default geometry per dataset: (image_size, patch_size).
DEFAULT_GEOMETRY: dict[str, tuple[int, int]] = {
    "shapes": (64, 8),
    "cifar10": (32, 4),
    "mnist": (28, 4),
    "imagefolder": (64, 8),
}
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
MNIST_STATS = ((0.1307,), (0.3081,))
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are not where they are expected and downloading was not asked for."""


@dataclass
class DataBundle:
    train: Dataset[tuple[Tensor, int]]
    test: Dataset[tuple[Tensor, int]]
    classes: list[str]
    preprocessing: Preprocessing


@dataclass(frozen=True)
class DataOptions:
    dataset: str = "shapes"
    data_dir: Path = Path("data")
    download: bool = False
    image_size: int | None = None  # None: the dataset's default
    channels: int | None = None  # mnist: 1 (default) or 3; shapes: 3 (default) or 1
    randaugment: bool = False  # for natural images (cifar10, imagefolder)
    shapes_train: int = 50_000
    shapes_test: int = 5_000
    shapes_outliers: int = 0  # shape-less backgrounds added to the training set, labelled NO_SHAPE
    seed: int = 0
    val_fraction: float = 0.1  # imagefolder without a val/ folder: share of train/ held out
    preprocessing: Preprocessing | None = None  # fine-tuning: the checkpoint's recipe instead of the dataset's


def train_transform(p: Preprocessing, flip: bool, randaugment: bool) -> v2.Compose:
    steps: list[Any] = [v2.ToImage(), *channel_steps(p), *resize_steps(p)]
    steps.append(v2.RandomCrop(p.image_size, padding=max(1, p.image_size // 8), padding_mode="reflect"))
    if flip:
        steps.append(v2.RandomHorizontalFlip())
    if randaugment:
        steps.append(v2.RandAugment(num_ops=2, magnitude=9))
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(p.mean), list(p.std))]
    return v2.Compose(steps)


def channel_steps(p: Preprocessing) -> list[Any]:
    """Grayscale models take luminance (ITU-R 601-2) of RGB input; 1-channel input passes unchanged."""
    return [v2.Grayscale(num_output_channels=1)] if p.channels == 1 else []


def resize_steps(p: Preprocessing) -> list[Any]:
    """The evaluation resize for training images (always on tensors; augmentation follows it)."""
    mode = InterpolationMode(p.interpolation)
    if p.resize == "center_crop":
        return [v2.Resize(p.resize_size, interpolation=mode, antialias=True), v2.CenterCrop(p.image_size)]
    steps: list[Any] = [v2.Resize((p.resize_size, p.resize_size), interpolation=mode, antialias=True)]
    return steps + ([v2.CenterCrop(p.image_size)] if p.resize_size != p.image_size else [])


class ShapesDataset(Dataset[tuple[Tensor, int]]):
    """The procedural shapes, rendered once into memory; `masks` holds each shape's silhouette. With `outliers`,
    that many backgrounds without a shape follow the shapes, labelled `NO_SHAPE` (from a seed stream of their own)."""

    def __init__(
        self,
        n: int,
        seed: int,
        transform: Callable[[Tensor], Tensor] | None = None,
        sample: Callable[[int, int], ShapeSample] = make_sample,
        outliers: int = 0,
    ) -> None:
        images, labels, masks = render_dataset(n, seed, sample)
        if outliers:
            extra = render_dataset(outliers, seed + 2_000_003, make_background)
            images, labels, masks = (np.concatenate(pair) for pair in zip((images, labels, masks), extra, strict=True))
        self.images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()  # (n, 3, 64, 64) uint8
        self.labels = torch.from_numpy(labels)
        self.masks = torch.from_numpy(masks)  # (n, 64, 64) bool
        self.transform = transform
        self.classes = list(SHAPE_CLASSES)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        image = self.images[i]
        return (self.transform(image) if self.transform else image), int(self.labels[i])


class TransformedSubset(Dataset[tuple[Tensor, int]]):
    """A subset of an untransformed dataset with its own transform (for train/val splits)."""

    def __init__(self, subset: Subset[Any], transform: Callable[[Any], Tensor]) -> None:
        self.subset = subset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.subset)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        image, label = self.subset[i]
        return self.transform(image), int(label)


def build_data(opts: DataOptions) -> DataBundle:
    """Train and test datasets, class names and preprocessing for `opts.dataset`."""
    if opts.dataset == "shapes":
        return build_shapes(opts)
    if opts.dataset == "cifar10":
        return build_cifar10(opts)
    if opts.dataset == "mnist":
        return build_mnist(opts)
    if opts.dataset == "imagefolder":
        return build_imagefolder(opts)
    raise ValueError(f"unknown dataset {opts.dataset!r}; choose one of {DATASETS}")


def image_size_for(opts: DataOptions) -> int:
    return opts.image_size or DEFAULT_GEOMETRY[opts.dataset][0]


def shapes_preprocessing(image_size: int = SHAPES_SIZE, channels: int = 3) -> Preprocessing:
    # Measured over 20,000 rendered samples (seed 0); fixed so every shapes checkpoint agrees.
    if channels == 1:  # the classes do not depend on colour, and shape/background differ in luminance
        return Preprocessing(image_size, 1, (0.5,), (0.192,), "squash")
    return Preprocessing(image_size, 3, (0.4998, 0.5002, 0.4991), (0.2656, 0.2747, 0.2625), "squash")


def build_shapes(opts: DataOptions) -> DataBundle:
    p = opts.preprocessing or shapes_preprocessing(image_size_for(opts), opts.channels or 3)
    # Test data comes from a different seed stream than training data, so the two never overlap.
    train = ShapesDataset(
        opts.shapes_train, opts.seed, train_transform(p, flip=True, randaugment=False), outliers=opts.shapes_outliers
    )
    test = ShapesDataset(opts.shapes_test, opts.seed + 1_000_003, EvalTransform(p))
    return DataBundle(train, test, list(SHAPE_CLASSES), p)


def torchvision_dataset(cls: Any, root: Path, train: bool, download: bool, expected: Path, **kw: Any) -> Any:
    try:
        return cls(str(root), train=train, download=download, **kw)
    except RuntimeError as e:
        if "not found" in str(e).lower() or "download" in str(e).lower():
            raise DatasetNotFoundError(
                f"{cls.__name__} files not found under {expected}; pass --download to fetch them "
                f"or point --data-dir at a folder that holds them"
            ) from e
        raise


def build_cifar10(opts: DataOptions) -> DataBundle:
    p = opts.preprocessing or Preprocessing(image_size_for(opts), 3, *CIFAR10_STATS, resize="squash")
    expected = opts.data_dir / "cifar-10-batches-py"
    ds = datasets.CIFAR10
    train = torchvision_dataset(
        ds, opts.data_dir, True, opts.download, expected, transform=train_transform(p, True, opts.randaugment)
    )
    test = torchvision_dataset(ds, opts.data_dir, False, opts.download, expected, transform=EvalTransform(p))
    return DataBundle(train, test, list(train.classes), p)


def build_mnist(opts: DataOptions) -> DataBundle:
    channels = opts.preprocessing.channels if opts.preprocessing else opts.channels or 1
    if channels not in (1, 3):
        raise ValueError(f"mnist channels must be 1 or 3, got {channels}")
    mean, std = MNIST_STATS
    p = opts.preprocessing or Preprocessing(image_size_for(opts), channels, mean * channels, std * channels)
    gray = [v2.Grayscale(num_output_channels=3)] if channels == 3 else []
    expected = opts.data_dir / "MNIST" / "raw"
    ds = datasets.MNIST
    # No flips: a mirrored digit is a different (or no) digit.
    train_tf = v2.Compose([*gray, train_transform(p, flip=False, randaugment=False)])
    test_tf = v2.Compose([*gray, EvalTransform(p)])
    train = torchvision_dataset(ds, opts.data_dir, True, opts.download, expected, transform=train_tf)
    test = torchvision_dataset(ds, opts.data_dir, False, opts.download, expected, transform=test_tf)
    classes = [c.split(" - ")[0] for c in train.classes]  # "0 - zero" -> "0"
    return DataBundle(train, test, classes, p)


def build_imagefolder(opts: DataOptions) -> DataBundle:
    """`data_dir/train/<class>/*` and, optionally, `data_dir/val/<class>/*` (else a split of train)."""
    train_dir = opts.data_dir / "train"
    if not train_dir.is_dir():
        raise DatasetNotFoundError(
            f"imagefolder expects {train_dir}/<class name>/<image files> (and optionally "
            f"{opts.data_dir / 'val'}/<class name>/...); {train_dir} does not exist"
        )
    p = opts.preprocessing or Preprocessing(image_size_for(opts), 3, *IMAGENET_STATS, resize="center_crop")
    train_tf = train_transform(p, flip=True, randaugment=opts.randaugment)
    val_dir = next((opts.data_dir / d for d in ("val", "test") if (opts.data_dir / d).is_dir()), None)
    if val_dir is not None:
        train = datasets.ImageFolder(str(train_dir), transform=train_tf)
        test = datasets.ImageFolder(str(val_dir), transform=EvalTransform(p))
        if test.classes != train.classes:
            raise ValueError(f"class folders differ between {train_dir} and {val_dir}")
        return DataBundle(train, test, list(train.classes), p)
    full = datasets.ImageFolder(str(train_dir))
    order = np.random.default_rng(opts.seed).permutation(len(full)).tolist()
    n_val = max(1, int(len(full) * opts.val_fraction))
    return DataBundle(
        TransformedSubset(Subset(full, order[n_val:]), train_tf),
        TransformedSubset(Subset(full, order[:n_val]), EvalTransform(p)),
        list(full.classes),
        p,
    )
