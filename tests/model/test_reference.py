"""Reference statistics: the fit and the score against the Mahalanobis distance computed the long way, the
checkpoint round trip (the model's version kept, tampering caught, older checkpoints still loading), the
command over image folders, and training writing them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from harness.preloaded import run_command
from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.reference import Reference, fit
from model.shapes import SHAPE_CLASSES, make_sample
from model.version import numeric_version
from tests.support.checkpoints import TINY_PREPROCESSING, tiny_model


def test_the_score_is_the_mahalanobis_distance_to_the_nearest_class_mean() -> None:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(300) % 3
    embeddings = torch.randn(300, 5, generator=g) * torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]) + labels[:, None] * 4.0
    reference = fit(embeddings, labels, num_classes=4, ridge=0.0)  # class 3: no images
    assert reference.prior.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    means = torch.stack([embeddings[labels == c].double().mean(0) for c in range(3)])
    centred = embeddings.double() - means[labels]
    covariance = centred.T @ centred / 300
    queries = torch.randn(7, 5, generator=g) * 5
    long_way = torch.stack(
        [
            torch.stack([((q.double() - m) @ torch.linalg.solve(covariance, q.double() - m)).sqrt() for m in means])
            for q in queries
        ]
    ).amin(1)
    torch.testing.assert_close(reference.distances(queries).double(), long_way, rtol=1e-4, atol=1e-4)
    far = reference.distances(means.float().mean(0, keepdim=True) + 100)
    assert float(far) > float(reference.distances(means[:1].float()))  # further from the data: higher
    probabilities = torch.full((7, 4), 0.25)
    torch.testing.assert_close(reference.scores(queries, probabilities), reference.distances(queries))  # the default


def test_the_held_out_99th_percentile_is_each_image_scored_by_statistics_fitted_without_it() -> None:
    """`held_out_p99`: five folds, each scored by statistics fitted on the other four; the 99th percentile of
    those scores. Fewer than ten images keep none."""
    g = torch.Generator().manual_seed(1)
    labels = torch.arange(500) % 4
    embeddings = torch.randn(500, 6, generator=g) + labels[:, None] * 3.0
    reference = fit(embeddings, labels, num_classes=4)
    fold = torch.arange(500) % 5
    held_out = torch.cat(
        [fit(embeddings[fold != k], labels[fold != k], 4).distances(embeddings[fold == k]) for k in range(5)]
    )
    assert reference.held_out_p99 == pytest.approx(float(held_out.quantile(0.99)), rel=1e-5)
    assert reference.held_out_p99 > float(reference.distances(embeddings).quantile(0.99))  # unseen images score higher
    assert fit(embeddings[:9], labels[:9], num_classes=4).held_out_p99 is None
    again = Reference.from_tensors(reference.tensors())
    assert again.held_out_p99 == pytest.approx(reference.held_out_p99)
    older = {k: v for k, v in reference.tensors().items() if not k.endswith("held_out_p99")}
    assert Reference.from_tensors(older).held_out_p99 is None  # statistics saved before it was kept


def test_a_max_softmax_reference_scores_one_minus_the_top_probability() -> None:
    """For a model trained with outlier exposure: the score is 1 - its top probability, its 99th percentile over
    the images is `held_out_p99`, and the kind travels with the statistics (older ones are Mahalanobis)."""
    g = torch.Generator().manual_seed(2)
    labels = torch.arange(200) % 4
    embeddings = torch.randn(200, 6, generator=g) + labels[:, None] * 3.0
    probabilities = torch.softmax(torch.randn(200, 4, generator=g) * 3, dim=-1)
    reference = fit(embeddings, labels, num_classes=4, score="max_softmax", probabilities=probabilities)
    expected = 1 - probabilities.amax(-1)
    torch.testing.assert_close(reference.scores(embeddings, probabilities), expected)
    assert reference.held_out_p99 == pytest.approx(float(expected.quantile(0.99)))
    assert reference.prior.tolist() == pytest.approx([0.25] * 4)  # the drift gauge's prior, as for any score
    again = Reference.from_tensors(reference.tensors())
    assert again.score == "max_softmax" and again.held_out_p99 == pytest.approx(reference.held_out_p99)
    assert "reference.score" not in fit(embeddings, labels, num_classes=4).tensors()  # Mahalanobis: as before
    with pytest.raises(ValueError, match="probabilities"):
        fit(embeddings, labels, num_classes=4, score="max_softmax")
    with pytest.raises(ValueError, match="score must be one of"):
        Reference(reference.means, reference.precision, reference.prior, 200, score="energy")  # type: ignore[arg-type]


def test_reference_statistics_travel_in_the_checkpoint_and_keep_its_version(tmp_path: Path) -> None:
    model = tiny_model()
    plain, with_reference = tmp_path / "plain.safetensors", tmp_path / "ref.safetensors"
    save_checkpoint(plain, model, list(SHAPE_CLASSES), TINY_PREPROCESSING)
    embeddings, labels = torch.randn(50, 32), torch.arange(50) % 10
    reference = fit(embeddings, labels, 10)
    save_checkpoint(with_reference, model, list(SHAPE_CLASSES), TINY_PREPROCESSING, reference=reference)
    assert load_checkpoint(plain).reference is None  # a checkpoint without them loads as before
    loaded = load_checkpoint(with_reference)
    assert loaded.version == load_checkpoint(plain).version and loaded.reference is not None
    torch.testing.assert_close(loaded.reference.distances(embeddings), reference.distances(embeddings))
    assert loaded.reference.images == 50
    with safe_open(str(with_reference), framework="pt") as f:  # tamper with the statistics alone
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    tensors["reference.means"] = tensors["reference.means"] + 1
    save_file(tensors, str(tmp_path / "tampered.safetensors"), metadata=metadata)
    with pytest.raises(CheckpointError, match="reference statistics hash mismatch"):
        load_checkpoint(tmp_path / "tampered.safetensors")
    with pytest.raises(ValueError, match="do not fit the model"):
        save_checkpoint(
            tmp_path / "x.safetensors",
            model,
            list(SHAPE_CLASSES),
            TINY_PREPROCESSING,
            reference=fit(torch.randn(10, 8), torch.arange(10) % 10, 10),
        )


def test_mismatched_statistics_are_refused() -> None:
    with pytest.raises(ValueError, match="disagree"):
        Reference(torch.zeros(3, 4), torch.eye(5), torch.ones(3) / 3, 10)
    with pytest.raises(ValueError, match="at least 2 images"):
        fit(torch.randn(1, 4), torch.zeros(1), 3)


def write_shapes(folder: Path, by_class: bool, n: int = 24) -> None:
    for i in range(n):
        sample = make_sample(99, i)
        where = folder / SHAPE_CLASSES[sample.label] if by_class else folder
        where.mkdir(parents=True, exist_ok=True)
        sample.image.save(where / f"{i}.png")


@pytest.mark.parametrize("by_class", [True, False])
def test_the_command_labels_by_class_folders_or_by_the_model(tmp_path: Path, by_class: bool) -> None:
    ckpt = tmp_path / "tiny.safetensors"
    save_checkpoint(ckpt, tiny_model(), list(SHAPE_CLASSES), TINY_PREPROCESSING)
    write_shapes(tmp_path / "images", by_class)
    r = run_command(
        [sys.executable, "-m", "model.reference", str(ckpt), "--images", str(tmp_path / "images")],
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    how = "labelled by their class folders" if by_class else "labelled by the model's top-1"
    assert f"24 images in images/, {how}" in r.stdout
    loaded = load_checkpoint(ckpt)  # written in place
    # named as the service names it: the number, then the content hash
    version = numeric_version(loaded.content_hash)
    assert f"(version {version}, content hash {loaded.content_hash[:12]}: unchanged)" in r.stdout, r.stdout
    assert loaded.reference is not None and loaded.reference.images == 24
    assert loaded.training["reference"].endswith(how)


@pytest.mark.slow  # the command line, as a process of its own
def test_the_command_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny.safetensors"
    save_checkpoint(ckpt, tiny_model(), list(SHAPE_CLASSES), TINY_PREPROCESSING)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "bad" / "a.png")
    (tmp_path / "bad" / "b.png").write_bytes(b"not a png")
    for args, message in (
        (["--images", str(tmp_path / "none")], "not a folder"),
        (["--images", str(tmp_path / "empty")], "fewer than 2 image files"),
        (["--images", str(tmp_path / "bad")], "not a readable image"),
        (["--shapes", "1"], "at least 2"),
        (["--shapes", "8", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    ):
        r = run_command([sys.executable, "-m", "model.reference", str(ckpt), *args], timeout=120)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert load_checkpoint(ckpt).reference is None


@pytest.mark.slow
def test_the_bundled_models_scores_put_each_shifted_set_above_its_own_data() -> None:
    """The three kinds of shift evaluation.ood measures (shapes under noise or in unseen contrast, crops of real
    photographs, uniform noise), 200 images each against 200 held-out shapes, by the score the bundled statistics
    give: each ranks above (at 1,000 images AUROC 0.84 for noisy shapes, 0.988 to 0.999 for the others; at 200,
    0.837 and 0.985 to 0.999; the bounds leave room for sampling)."""
    import numpy as np

    from app.settings import BUNDLED_WEIGHTS
    from harness.shifted import auroc, held_out_shapes, shifted_sets
    from model.preprocessing import EvalTransform

    ckpt = load_checkpoint(BUNDLED_WEIGHTS)
    assert ckpt.reference is not None
    transform = EvalTransform(ckpt.preprocessing)

    def scores(make: Callable[[int], Image.Image], n: int) -> np.ndarray:
        with torch.inference_mode():
            logits, embedding, _ = ckpt.model.forward_with_embedding(
                torch.stack([transform(make(i)) for i in range(n)])
            )
        assert ckpt.reference is not None
        return ckpt.reference.scores(embedding, logits.softmax(-1)).numpy()

    inside = scores(held_out_shapes, 200)
    least = {"noisy shapes": 0.75, "low-contrast shapes": 0.97, "photographs": 0.96, "uniform noise": 0.98}
    for name, make in shifted_sets().items():
        outside = scores(make, 200)
        assert auroc(inside, outside) > least[name], name
        assert np.median(outside) > np.median(inside) * 2, name
