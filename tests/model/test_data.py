from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from model.data import DataOptions, DatasetNotFoundError, build_data
from model.shapes import SHAPE_CLASSES
from tests.support.datasets import write_cifar10, write_imagefolder, write_mnist


def test_shapes_bundle() -> None:
    data = build_data(DataOptions(dataset="shapes", shapes_train=40, shapes_test=20))
    x, y = data.train[0]
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32 and 0 <= y < 10
    assert len(data.train) == 40 and len(data.test) == 20
    assert data.classes == SHAPE_CLASSES
    assert data.preprocessing.image_size == 64 and data.preprocessing.channels == 3


def test_shapes_test_set_is_disjoint_from_train() -> None:
    data = build_data(DataOptions(dataset="shapes", shapes_train=50, shapes_test=50))
    train = {bytes(img.numpy()) for img in data.train.images}  # type: ignore[attr-defined]
    assert not train & {bytes(img.numpy()) for img in data.test.images}  # type: ignore[attr-defined]


def test_cifar10_through_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_cifar10(tmp_path, monkeypatch)
    data = build_data(DataOptions(dataset="cifar10", data_dir=tmp_path))
    assert len(data.train) == 100 and len(data.test) == 20
    assert data.classes[0] == "airplane"
    x, _ = data.test[0]
    assert x.shape == (3, 32, 32)


@pytest.mark.parametrize("channels", [1, 3])
def test_mnist_through_torchvision(tmp_path: Path, channels: int) -> None:
    write_mnist(tmp_path)
    data = build_data(DataOptions(dataset="mnist", data_dir=tmp_path, channels=channels))
    assert data.classes == [str(i) for i in range(10)]
    x, y = data.test[3]
    assert x.shape == (channels, 28, 28) and y == 3
    assert data.preprocessing.channels == channels and len(data.preprocessing.mean) == channels


def test_mnist_train_transform_never_flips(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    data = build_data(DataOptions(dataset="mnist", data_dir=tmp_path))
    names = [type(t).__name__ for t in data.train.transform.transforms[-1].transforms]  # type: ignore[attr-defined]
    assert "RandomHorizontalFlip" not in names and "RandomCrop" in names


def test_imagefolder_with_val(tmp_path: Path) -> None:
    write_imagefolder(tmp_path)
    data = build_data(DataOptions(dataset="imagefolder", data_dir=tmp_path, image_size=32))
    assert data.classes == ["cat", "dog", "fox"]
    assert len(data.train) == 24 and len(data.test) == 9
    assert data.train[0][0].shape == (3, 32, 32)
    assert data.preprocessing.resize == "center_crop"


def test_imagefolder_without_val_splits_train(tmp_path: Path) -> None:
    write_imagefolder(tmp_path)
    shutil.rmtree(tmp_path / "val")
    data = build_data(DataOptions(dataset="imagefolder", data_dir=tmp_path, image_size=32))
    assert len(data.train) + len(data.test) == 24 and len(data.test) == 2


@pytest.mark.parametrize(
    ("dataset", "where"),
    [("cifar10", "cifar-10-batches-py"), ("mnist", "MNIST/raw"), ("imagefolder", "train")],
)
def test_missing_dataset_says_where(tmp_path: Path, dataset: str, where: str) -> None:
    with pytest.raises(DatasetNotFoundError, match=where) as e:
        build_data(DataOptions(dataset=dataset, data_dir=tmp_path, download=False))
    assert str(tmp_path) in str(e.value)
