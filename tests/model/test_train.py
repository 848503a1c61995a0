from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model import evaluate, train
from model.checkpoint import load_checkpoint
from tests.model.fake_datasets import write_cifar10, write_imagefolder, write_mnist

TINY_ARGS = ["--dim", "32", "--depth", "1", "--heads", "2", "--batch-size", "8", "--workers", "0", "--no-progress"]


def run(tmp_path: Path, *args: str) -> tuple[train.History, Path]:
    out = tmp_path / "run" / "vit.safetensors"
    return train.main([*args, *TINY_ARGS, "--output", str(out)]), out


def test_train_imagefolder_writes_checkpoint_metrics_and_plot(tmp_path: Path) -> None:
    write_imagefolder(tmp_path / "data")
    history, out = run(
        tmp_path,
        "--dataset",
        "imagefolder",
        "--data-dir",
        str(tmp_path / "data"),
        "--image-size",
        "32",
        "--epochs",
        "2",
    )
    assert [e["epoch"] for e in history.epochs] == [1, 2]
    ckpt = load_checkpoint(out)
    assert ckpt.classes == ["cat", "dog", "fox"]
    assert ckpt.config.image_size == 32 and ckpt.config.dim == 32
    assert ckpt.training["dataset"] == "imagefolder"
    assert ckpt.training["init"] == "mimetic"  # the default
    assert ckpt.training["test_accuracy"] == pytest.approx(history.best_accuracy, abs=1e-6)
    metrics = json.loads((out.parent / "vit.metrics.json").read_text())
    assert len(metrics["epochs"]) == 2 and {"train_loss", "train_accuracy", "test_accuracy"} <= set(
        metrics["epochs"][0]
    )
    assert (out.parent / "vit.curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_cifar10(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_cifar10(tmp_path / "data", monkeypatch)
    data = ("--dataset", "cifar10", "--data-dir", str(tmp_path / "data"))
    _, out = run(tmp_path, *data, "--epochs", "1", "--init", "timm")
    ckpt = load_checkpoint(out)
    assert ckpt.config.image_size == 32 and ckpt.config.patch_size == 4 and ckpt.classes[-1] == "truck"
    assert ckpt.training["init"] == "timm"


@pytest.mark.parametrize("channels", ["1", "3"])
def test_train_mnist(tmp_path: Path, channels: str) -> None:
    write_mnist(tmp_path / "data")
    _, out = run(
        tmp_path, "--dataset", "mnist", "--data-dir", str(tmp_path / "data"), "--channels", channels, "--epochs", "1"
    )
    ckpt = load_checkpoint(out)
    assert ckpt.config.in_channels == int(channels) and ckpt.preprocessing.channels == int(channels)


def test_resume_continues_where_it_stopped(tmp_path: Path) -> None:
    args = ("--dataset", "shapes", "--shapes-train", "32", "--shapes-test", "16")
    first, _out = run(tmp_path, *args, "--epochs", "1")
    resumed, _ = run(tmp_path, *args, "--epochs", "3", "--resume")
    assert [e["epoch"] for e in resumed.epochs] == [1, 2, 3]
    assert resumed.epochs[0] == first.epochs[0]


def test_evaluate_shapes_reports_pointing_game(tmp_path: Path) -> None:
    _, out = run(tmp_path, "--dataset", "shapes", "--shapes-train", "32", "--shapes-test", "16", "--epochs", "1")
    report = tmp_path / "eval.json"
    result = evaluate.main(["--checkpoint", str(out), "--samples", "40", "--batch-size", "16", "--json", str(report)])
    assert result.samples == 40
    assert result.pointing_game is not None and 0.0 <= result.pointing_game <= 1.0
    assert sum(map(sum, result.confusion_matrix)) == 40
    saved = json.loads(report.read_text())
    assert saved["accuracy"] == result.accuracy and saved["dataset"] == "shapes"


def test_missing_dataset_is_a_clear_error(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "model.train", "--dataset", "cifar10", "--data-dir", str(tmp_path), "--epochs", "1"],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0
    assert "pass --download" in r.stderr and "cifar-10-batches-py" in r.stderr


def test_help_lists_the_options() -> None:
    r = subprocess.run([sys.executable, "-m", "model.train", "--help"], capture_output=True, text=True, check=True)
    for flag in ("--dataset", "--epochs", "--lr", "--warmup-epochs", "--label-smoothing", "--resume", "--preset"):
        assert flag in r.stdout


def test_torchrun_trains_data_parallel(tmp_path: Path) -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))  # installed with torch
    out = tmp_path / "ddp.safetensors"
    r = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "model.train", "--dataset", "shapes",
         "--shapes-train", "32", "--shapes-test", "16", "--epochs", "1", *TINY_ARGS, "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "x2" in r.stdout  # two processes trained
    assert load_checkpoint(out).training["dataset"] == "shapes"
