"""`python -m model.train --head DIR --backbone NAME`: a head taught offline from a folder of examples, written
where the service finds it, and what it refuses, as a process of its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from harness.preloaded import run_command
from model import train
from model.checkpoint import load_checkpoint
from model.preprocessing import EvalTransform
from model.shapes_second import make_sample
from model.taught_head import load
from model.teach import embed, head_path

BUNDLED = Path(__file__).resolve().parents[2] / "weights" / "vit-shapes.safetensors"
pytestmark = pytest.mark.slow  # command lines, as processes of their own


def write_examples(folder: Path, per_class: int, classes: tuple[int, ...] = (0, 7, 5)) -> dict[str, list[Path]]:
    """`per_class` shapes of each of `classes` (circle, ring, star by default) as PNGs under folder/<name>/: the
    second renderer's, images of the user's own as docs/api.md teaches with, not the backbone's training renderer."""
    written: dict[str, list[Path]] = {}
    names = {0: "round", 7: "donut", 5: "pointy"}
    index = 0
    for label in classes:
        files = written.setdefault(names[label], [])
        (folder / names[label]).mkdir(parents=True, exist_ok=True)
        while len(files) < per_class:
            sample = make_sample(31337, index)
            index += 1
            if sample.label == label:
                files.append(folder / names[label] / f"{index}.png")
                sample.image.save(files[-1])
    return written


def teach(*args: str) -> tuple[int, str, str]:
    r = run_command([sys.executable, "-m", "model.train", *args], timeout=180)
    return r.returncode, r.stdout, r.stderr


def test_a_folder_of_examples_becomes_a_head_beside_the_backbone(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    (repository / "shapes.safetensors").write_bytes(BUNDLED.read_bytes())
    examples = write_examples(tmp_path / "mine", 6)
    code, out, err = teach("--head", str(tmp_path / "mine"), "--backbone", "shapes", "--repository", str(repository))
    assert code == 0, err
    path = head_path(repository / "shapes.safetensors", "mine")
    assert path == repository / "heads" / "shapes" / "mine.safetensors" and path.is_file()
    backbone = load_checkpoint(repository / "shapes.safetensors")
    head = load(path, backbone.content_hash)
    assert head.classes == ("donut", "pointy", "round") and head.counts == (6, 6, 6)  # the folders, sorted
    assert f"head 'mine' on shapes.safetensors ({backbone.identity}): 3 classes (donut 6, pointy 6, round 6)" in out
    assert head.estimate is not None and f"rule {head.rule}: {head.estimate.accuracy:.1%} held out (5-fold" in out
    # the head answers for its examples' embeddings as the service embeds them, and for shapes it was not taught
    transform = EvalTransform(backbone.preprocessing)
    fresh = write_examples(tmp_path / "fresh", 10)
    for i, cls in enumerate(head.classes):
        with torch.no_grad():
            taught = embed(
                backbone, iter([torch.stack([transform(Image.open(f).convert("RGB")) for f in examples[cls]])])
            )
            unseen = embed(
                backbone, iter([torch.stack([transform(Image.open(f).convert("RGB")) for f in fresh[cls][6:]])])
            )
        assert (head.logits(taught).argmax(1) == i).all(), cls
        assert (head.logits(unseen).argmax(1) == i).float().mean() >= 0.75, cls
    # by path, with a name and a rule of its own
    code, out, err = teach(
        "--head", str(tmp_path / "mine"), "--backbone", str(BUNDLED), "--name", "v2", "--rule", "means",
        "--output", str(tmp_path / "v2.safetensors"),
    )  # fmt: skip
    assert code == 0, err
    assert load(tmp_path / "v2.safetensors").rule == "means" and "head 'v2' on vit-shapes.safetensors" in out


def test_what_a_head_cannot_be_taught_from_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_examples(tmp_path / "one", 3, classes=(0,))
    write_examples(tmp_path / "empty", 3)
    (tmp_path / "empty" / "hollow").mkdir()
    write_examples(tmp_path / "broken", 3)
    (tmp_path / "broken" / "round" / "zz.png").write_bytes(b"not a png")
    model = str(BUNDLED)
    cases = [
        (["--head", str(tmp_path / "one"), "--backbone", model], "a head tells classes apart: give at least two"),
        (["--head", str(tmp_path / "empty"), "--backbone", model], "class 'hollow' has no example image"),
        (["--head", str(tmp_path / "broken"), "--backbone", model], "zz.png (class 'round') is not an image"),
        (["--head", str(tmp_path / "none"), "--backbone", model], "not a folder"),
        (["--head", str(tmp_path / "one"), "--backbone", "shapes"], "for a model's name, give --repository"),
        (["--head", str(tmp_path / "one"), "--backbone", model, "--name", "../x"], "is not a head name"),
    ]
    for args, message in cases[:2]:  # the command itself: exit status 2, one line, no traceback
        code, _, err = teach(*args)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
    for args, message in cases[2:]:  # the same entry point in this process (a second each, not a start each)
        with pytest.raises(SystemExit) as exited:
            train.cli(args)
        assert exited.value.code == 2 and message in capsys.readouterr().err, args
    assert not (BUNDLED.parent / "heads").exists()
