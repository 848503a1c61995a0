from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model import evaluate, train
from model.checkpoint import load_checkpoint
from tests.support.checkpoints import Pretrained
from tests.support.datasets import write_cifar10, write_imagefolder, write_mnist

pytestmark = pytest.mark.slow  # trains, and runs the training command

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
    assert ckpt.reference is not None and ckpt.reference.means.shape == (3, 32)  # statistics of the val images
    assert ckpt.training["reference"] == f"{ckpt.reference.images} imagefolder test images, labelled"
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


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What `python -m model.train ARGV` tells a user it refuses: the exit's message (SystemExit, printed
    without a traceback) and stderr; the exit status is not 0."""
    with pytest.raises(SystemExit) as exited:
        train.main(list(argv))
    assert exited.value.code not in (0, None)
    return f"{exited.value.code}\n{capsys.readouterr().err}"


def test_missing_dataset_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    error = refusal(capsys, "--dataset", "cifar10", "--data-dir", str(tmp_path), "--epochs", "1")
    assert "pass --download" in error and "cifar-10-batches-py" in error


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epochs", "0"], "argument --epochs: must be at least 1, got 0"),  # it trained nothing and said it had
        (["--batch-size", "-4"], "argument --batch-size: must be at least 1, got -4"),
        (["--epochs", "two"], "argument --epochs: 'two' is not a whole number"),
        (["--shapes-train", "0"], "argument --shapes-train: must be at least 1"),
        (["--workers", "-1"], "argument --workers: must be at least 0, got -1"),
        (["--dim", "100", "--heads", "3"], "the model's shape: dim 100 is not divisible by heads 3"),
    ],
)
def test_counts_below_their_least_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    error = refusal(capsys, *argv, "--output", str(tmp_path / "x.safetensors"))
    assert error.startswith("2\n") and message in error
    assert not (tmp_path / "x.safetensors").exists()


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        train.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--dataset", "--epochs", "--lr", "--warmup-epochs", "--label-smoothing", "--resume", "--preset"):
        assert flag in out


def test_torchrun_trains_data_parallel(tmp_path: Path) -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))  # installed with torch
    out = tmp_path / "ddp.safetensors"
    r = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "model.train",
            "--dataset",
            "shapes",
            "--shapes-train",
            "32",
            "--shapes-test",
            "16",
            "--epochs",
            "1",
            *TINY_ARGS,
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "x2" in r.stdout  # two processes trained
    assert load_checkpoint(out).training["dataset"] == "shapes"


def test_fine_tune_a_converted_model_on_an_image_folder(
    tmp_path: Path, pretrained: Callable[[str], Pretrained]
) -> None:
    """A converted timm ViT fine-tunes at another resolution on new classes, and its loss falls."""
    write_imagefolder(tmp_path / "data", per_class=12)
    source = load_checkpoint(pretrained("timm").checkpoint)
    out = tmp_path / "ft" / "vit.safetensors"
    history = train.main(
        [
            "--init-from",
            source.path,
            "--dataset",
            "imagefolder",
            "--data-dir",
            str(tmp_path / "data"),
            "--image-size",
            "64",
            "--epochs",
            "4",
            "--batch-size",
            "8",
            "--workers",
            "0",
            "--no-progress",
            "--output",
            str(out),
        ]
    )
    losses = [e["train_loss"] for e in history.epochs]
    assert losses[-1] < 0.7 * losses[0], losses
    ckpt = load_checkpoint(out)
    assert ckpt.classes == ["cat", "dog", "fox"] and ckpt.config.num_classes == 3
    assert ckpt.config.image_size == 64 and ckpt.config.dim == source.config.dim  # same backbone, new size
    assert ckpt.model.pos_embed.shape == (1, 1 + 4 * 4, source.config.dim)  # 14x14 positions resampled to 4x4
    p = ckpt.preprocessing  # the source's recipe, at the new size
    assert (p.image_size, p.mean, p.crop_pct, p.interpolation) == (64, source.preprocessing.mean, 0.9, "bicubic")
    assert ckpt.training["init_from"]["version"] == source.version
    assert ckpt.training["init_from"]["converted_from"]["source"] == "timm"
    assert ckpt.training["lr"] == train.FINETUNE_LR and ckpt.training["layer_decay"] == train.FINETUNE_LAYER_DECAY
    # and the rest of the recipe a rerun needs, at their defaults here
    assert (ckpt.training["warmup_epochs"], ckpt.training["weight_decay"], ckpt.training["label_smoothing"]) == (
        1.0,
        0.05,
        0.1,
    )


def test_freeze_backbone_trains_the_head_only(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """Linear probing: every backbone tensor is unchanged; the head (same classes: kept, then trained) moves."""
    source = load_checkpoint(tiny_checkpoint)
    out = tmp_path / "probe.safetensors"
    train.main(
        [
            "--init-from",
            str(tiny_checkpoint),
            "--dataset",
            "shapes",
            "--shapes-train",
            "32",
            "--shapes-test",
            "16",
            "--freeze-backbone",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--workers",
            "0",
            "--no-progress",
            "--output",
            str(out),
        ]
    )
    before, after = source.model.state_dict(), load_checkpoint(out).model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"head.weight", "head.bias"}


def test_same_classes_keep_the_head_and_new_classes_replace_it(tmp_path: Path, tiny_checkpoint: Path) -> None:
    source = load_checkpoint(tiny_checkpoint)  # shapes classes
    args = [
        "--init-from",
        str(tiny_checkpoint),
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--workers",
        "0",
        "--no-progress",
        "--lr",
        "0",
        "--warmup-epochs",
        "0",
    ]
    shapes = ["--dataset", "shapes", "--shapes-train", "16", "--shapes-test", "8"]
    train.main([*args, *shapes, "--output", str(tmp_path / "same.safetensors")])
    kept = load_checkpoint(tmp_path / "same.safetensors").model.state_dict()["head.weight"]
    assert torch.equal(kept, source.model.state_dict()["head.weight"])  # lr 0: nothing moved, head kept
    write_imagefolder(tmp_path / "data")
    folder = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"), "--image-size", "32"]
    train.main([*args, *folder, "--output", str(tmp_path / "new.safetensors")])
    assert load_checkpoint(tmp_path / "new.safetensors").model.state_dict()["head.weight"].shape == (3, 32)


def test_layer_decay_scales_learning_rates_by_depth(tiny_checkpoint: Path) -> None:
    model = load_checkpoint(tiny_checkpoint).model  # depth 2
    groups = train.param_groups(model, 0.05, layer_decay=0.5)
    scale_of = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert scale_of[id(named["patch_embed.proj.weight"])] == 0.5**3
    assert scale_of[id(named["blocks.0.attn.qkv.weight"])] == 0.5**2
    assert scale_of[id(named["blocks.1.mlp.fc1.weight"])] == 0.5
    assert scale_of[id(named["head.weight"])] == 1.0
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert decay_of[id(named["head.bias"])] == 0.0 and decay_of[id(named["head.weight"])] == 0.05


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dim", "64"], "--init-from takes the architecture from the checkpoint; drop --dim"),
        (["--image-size", "36"], "cannot fine-tune"),
    ],
)
def test_fine_tuning_errors_are_clear(
    tiny_checkpoint: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = refusal(
        capsys,
        "--init-from",
        str(tiny_checkpoint),
        "--shapes-train",
        "8",
        "--shapes-test",
        "8",
        "--epochs",
        "1",
        *extra,
    )
    assert message in error, error


@pytest.mark.parametrize("options", [{"rope": "axial"}, {"rel_pos_bias": True}])
def test_rotary_and_relative_position_models_fine_tune_at_their_own_size_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: dict[str, object]
) -> None:
    """Their tables are the source's, for its grid: another --image-size is refused; the same size trains."""
    from model.checkpoint import save_checkpoint
    from model.shapes import SHAPE_CLASSES
    from model.vit import ViT, ViTConfig
    from tests.support.checkpoints import TINY, TINY_PREPROCESSING

    path = tmp_path / "positions.safetensors"
    save_checkpoint(path, ViT(ViTConfig(**{**TINY.to_dict(), **options})), list(SHAPE_CLASSES), TINY_PREPROCESSING)
    write_imagefolder(tmp_path / "data")
    data = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "data")]
    common = ["--init-from", str(path), *data, "--epochs", "1", "--batch-size", "8", "--workers", "0", "--no-progress"]
    error = refusal(capsys, *common, "--image-size", "48")
    assert "cannot fine-tune" in error and "keep --image-size 32" in error
    train.main([*common, "--image-size", "32", "--output", str(tmp_path / "out.safetensors")])
    assert load_checkpoint(tmp_path / "out.safetensors").config.image_size == 32


@pytest.mark.parametrize(
    "flags",
    [
        ["--norm", "post"],
        ["--head", "mlp", "--head-hidden", "16"],
        ["--attention-pattern", "axial"],
        ["--norm", "post", "--head", "mlp", "--attention-pattern", "axial"],
    ],
)
def test_variants_train_save_load_and_evaluate(tmp_path: Path, flags: list[str]) -> None:
    _, out = run(
        tmp_path, "--dataset", "shapes", "--shapes-train", "32", "--shapes-test", "16", "--epochs", "1", *flags
    )
    config = load_checkpoint(out).config
    given = dict(zip(flags[0::2], flags[1::2], strict=True))
    assert config.norm == given.get("--norm", "pre") and config.head == given.get("--head", "linear")
    assert config.attention_pattern == given.get("--attention-pattern", "full")
    for method in ("rollout", "gradient"):
        result = evaluate.main(
            ["--checkpoint", str(out), "--samples", "24", "--batch-size", "12", "--attention", method]
        )
        assert result.pointing_game is not None and 0.0 <= result.pointing_game <= 1.0


def test_fine_tuning_refuses_variant_flags(tiny_checkpoint: Path) -> None:
    with pytest.raises(SystemExit):
        train.parse_args(["--init-from", str(tiny_checkpoint), "--attention-pattern", "axial"])


def test_the_bundled_checkpoints_maps_point_at_the_shape() -> None:
    """Both the class-agnostic and the class-specific maps of a trained model find the shape far above chance."""
    from app.settings import BUNDLED_WEIGHTS

    for method in ("rollout", "gradient"):
        result = evaluate.main(["--checkpoint", str(BUNDLED_WEIGHTS), "--samples", "200", "--attention", method])
        assert result.pointing_game is not None and result.pointing_game > 0.9, (method, result.pointing_game)


def test_outliers_are_trained_towards_equal_probabilities(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0], [1.0, 2.0, 3.0]])
    labels = torch.tensor([0, -1, 2])  # the middle one: a background without a shape
    ce = torch.nn.functional.cross_entropy(logits[[0, 2]], labels[[0, 2]], label_smoothing=0.1, reduction="sum")
    uniform = -torch.log_softmax(logits[1], -1).mean()
    expected = (ce + train.OUTLIER_WEIGHT * uniform) / 3
    torch.testing.assert_close(train.classification_loss(logits, labels, 0.1), expected)
    history, out = run(
        tmp_path,
        *("--dataset", "shapes", "--shapes-train", "32", "--shapes-test", "16", "--shapes-outliers", "8"),
        *("--epochs", "1", "--ood-score", "max_softmax"),
    )
    ckpt = load_checkpoint(out)
    assert ckpt.training["train_outliers"] == 8 and ckpt.reference is not None and ckpt.reference.score == "max_softmax"
    assert 0.0 <= history.epochs[0]["train_accuracy"] <= 1.0  # over the 32 labelled images, not the 40
    with pytest.raises(SystemExit):
        train.parse_args(["--dataset", "mnist", "--shapes-outliers", "8"])
    assert "--shapes-outliers adds shape-less backgrounds" in capsys.readouterr().err
