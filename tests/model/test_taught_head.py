"""Heads taught by example (model.taught_head): the rules against their definitions computed the long way, the
held-out estimate, the choice between the rules, the file and its backbone check, and the bundled model's backbone
taught from a few shapes of a renderer it never trained on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from model import taught_head
from model.checkpoint import load_checkpoint
from model.preprocessing import EvalTransform
from model.shapes_second import make_sample
from model.taught_head import HeadError, fit, load, save
from model.teach import embed

BUNDLED = Path(__file__).resolve().parents[2] / "weights" / "vit-shapes.safetensors"
CLASSES = ("a", "b", "c")


def blobs(per_class: int, spread: float, seed: int = 0, dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings about three centres, `per_class` each, in class order."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, dim, generator=g) * 3
    y = torch.arange(3).repeat_interleave(per_class)
    return centres[y] + spread * torch.randn(len(y), dim, generator=g), y


def test_the_means_rule_is_the_scaled_cosine_to_each_classs_unit_mean_of_centred_unit_embeddings() -> None:
    e, y = blobs(6, 2.0)
    head = fit(e, y, CLASSES, "hash", rule="means")
    x = F.normalize(e - e.mean(0), dim=1)
    means = F.normalize(torch.stack([x[y == c].mean(0) for c in range(3)]), dim=1)
    probe = torch.randn(5, 16)
    cosines = F.normalize(probe - e.mean(0), dim=1) @ means.T
    assert head.rule == "means" and head.counts == (6, 6, 6)
    torch.testing.assert_close(head.logits(probe), cosines * head.setting["scale"])
    assert head.setting["scale"] in taught_head.SCALES
    torch.testing.assert_close(head.probabilities(probe).sum(1), torch.ones(5))


def test_the_estimate_leaves_each_example_out_in_turn_centre_and_means_included() -> None:
    e, y = blobs(4, 6.0, seed=3)  # overlapping: some examples sit nearer another class's mean
    head = fit(e, y, CLASSES, "hash", rule="means")
    right = 0
    for i in range(len(y)):
        keep = torch.arange(len(y)) != i
        centre = e[keep].mean(0)
        x = F.normalize(e[keep] - centre, dim=1)
        means = torch.stack([x[y[keep] == c].mean(0) for c in range(3)])
        right += int((F.normalize(e[i] - centre, dim=0) @ F.normalize(means, dim=1).T).argmax() == y[i])
    assert head.estimate is not None and head.estimate.method == "leave-one-out" and head.estimate.examples == 12
    assert head.estimate.accuracy == pytest.approx(right / 12)
    assert 0 < head.estimate.accuracy < 1  # the set is one where holding out matters


def test_past_twelve_examples_the_estimate_is_stratified_k_fold() -> None:
    _, y = blobs(4, 1.0)
    method, held = taught_head.folds(torch.cat([y, y, y]))  # 36 examples, 12 a class
    assert method == "5-fold" and sorted(torch.cat(held).tolist()) == list(range(36))
    assert all(sorted(torch.cat([y, y, y])[f].tolist()).count(0) in (2, 3) for f in held)
    method, held = taught_head.folds(torch.tensor([0] * 20 + [1] * 3))  # the smallest class sets k
    assert method == "3-fold" and len(held) == 3


@pytest.mark.slow  # a few dozen fits by L-BFGS
def test_auto_keeps_the_logistic_regression_only_where_it_holds_out_better() -> None:
    rules = []
    for spread, seed in ((2.0, 0), (6.0, 3)):  # where it holds out better, and where the two tie
        e, y = blobs(8, spread, seed)
        means, logistic = fit(e, y, CLASSES, "h", rule="means"), fit(e, y, CLASSES, "h", rule="logistic")
        auto = fit(e, y, CLASSES, "h")
        assert means.estimate is not None and logistic.estimate is not None and auto.estimate is not None
        expected = "logistic" if logistic.estimate.accuracy > means.estimate.accuracy else "means"
        assert auto.rule == expected and auto.estimate == (logistic if expected == "logistic" else means).estimate
        rules.append(auto.rule)
        assert logistic.setting["penalty"] in taught_head.PENALTIES
        # the logistic head's weights are what its loss is least at: a step either way costs
        x, penalty, scale = F.normalize(e - e.mean(0), dim=1), logistic.setting["penalty"], logistic.setting["scale"]
        weight, bias = logistic.weight / scale, logistic.bias / scale  # as fitted, before the calibration
        nudge = 0.05 * torch.randn_like(weight)
        at, up, down = (
            float(F.cross_entropy(F.linear(x, w, bias), y) + penalty * w.square().sum())
            for w in (weight, weight + nudge, weight - nudge)
        )
        assert at < up and at < down
    assert rules == ["logistic", "means"]


@pytest.mark.parametrize(("spread", "seed"), [(1.0, 0), (6.0, 3)])
def test_a_head_is_as_sure_as_its_held_out_examples_show(spread: float, seed: int) -> None:
    """Its scale puts the held-out examples' mean top probability at their accuracy by Laplace's rule: not 1.0
    where all thirty are right (a least log loss would have no bound there), lower where some are wrong."""
    e, y = blobs(10, spread, seed)
    head = fit(e, y, CLASSES, "hash", rule="means")
    _, held = taught_head.folds(y)
    cosines = taught_head.held_out_logits(e, y, 3, held, "means", 1.0)
    right = int((cosines.argmax(1) == y).sum())
    sure = float((cosines * head.setting["scale"]).softmax(1).amax(1).mean())
    assert sure == pytest.approx((right + 1) / 32, abs=0.03), (right, sure)
    assert float(head.probabilities(e).amax(1).max()) < 1 - 1e-6


def test_one_example_of_a_class_leaves_nothing_to_hold_out() -> None:
    e, y = blobs(1, 1.0)
    head = fit(e, y, CLASSES, "hash")
    assert head.estimate is None and head.rule == "means"
    assert head.logits(e).argmax(1).tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("labels", "classes", "message"),
    [
        ([0, 0], ("a",), "at least two"),
        ([0, 0, 1], ("a", "b", "c"), "class 'c' has no example image"),
        ([0, 1], ("a", "a"), "class 'a' is named twice"),
        ([0, 1], ("a", " "), "an empty class name"),
    ],
)
def test_examples_a_head_cannot_be_taught_from_are_refused(
    labels: list[int], classes: tuple[str, ...], message: str
) -> None:
    with pytest.raises(HeadError, match=message):
        fit(torch.randn(len(labels), 4), labels, classes, "hash")


def test_the_file_keeps_the_head_and_names_its_backbone(tmp_path: Path) -> None:
    e, y = blobs(6, 3.0)
    head = fit(e, y, CLASSES, "f" * 64, rule="logistic")
    path = tmp_path / "heads" / "m" / "h.safetensors"
    save(head, path)
    back = load(path, "f" * 64)
    torch.testing.assert_close(back.logits(e), head.logits(e))
    assert (back.classes, back.rule, back.counts, back.estimate, back.setting) == (
        head.classes,
        head.rule,
        head.counts,
        head.estimate,
        head.setting,
    )
    assert [p.name for p in path.parent.iterdir()] == ["h.safetensors"]  # no partial file left
    with pytest.raises(HeadError, match="taught on the backbone with content hash ffffffffffff, and the model now has"):
        load(path, "0" * 64)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other), metadata={"format": "pt"})
    with pytest.raises(HeadError, match="not a taught head"):
        load(other)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(HeadError, match="not a readable safetensors file"):
        load(path)


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "../x", "x" * 65, "a..b"])
def test_a_head_name_is_never_a_path(name: str) -> None:
    with pytest.raises(HeadError, match="is not a head name"):
        taught_head.check_head_name(name)


@pytest.mark.slow  # 300 images of the second renderer
def test_the_bundled_backbone_learns_the_second_renderers_shapes_from_five_of_each() -> None:
    ckpt = load_checkpoint(BUNDLED)
    transform = EvalTransform(ckpt.preprocessing)
    samples = [make_sample(4242, i) for i in range(300)]
    pixels = torch.stack([transform(s.image.convert("RGB")) for s in samples])
    labels = torch.tensor([s.label for s in samples])
    e = embed(ckpt, iter(pixels.split(100)))
    taught = torch.cat([(labels[:100] == c).nonzero().flatten()[:5] for c in range(10)])
    assert len(taught) == 50
    head = fit(e[taught], labels[taught], ckpt.classes, ckpt.content_hash)
    assert head.embedding == "pre-logits" and head.dim == ckpt.config.dim
    assert head.estimate is not None and head.estimate.method == "5-fold" and head.estimate.accuracy >= 0.9
    assert taught_head.accuracy_of(head, e[100:], labels[100:]) >= 0.96  # the 200 images it was not taught
