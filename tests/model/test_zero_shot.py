"""CLIP and SigLIP from transformers, converted through the CLI with both towers and their tokenizers: the
probabilities for class names given at request time equal transformers' zero-shot pipeline (fp32, 1e-4)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.convert.__main__ import main as convert_main
from model.convert.converted import MAX_PIXEL_LEVELS
from model.preprocessing import EvalTransform
from model.reference import Reference
from model.zero_shot import check_template
from tests.support.zero_shot import (
    LABELS,
    TEMPLATE,
    Repo,
    clip_repo,
    open_clip_model,
    pipeline_scores,
    siglip2_repo,
    siglip_repo,
)

pytestmark = pytest.mark.slow  # builds and converts transformers models

REPOS: dict[str, Callable[[Path], Repo]] = {"clip": clip_repo, "siglip": siglip_repo}


@pytest.fixture(scope="module", params=["clip", "siglip"])
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Repo, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    repo = REPOS[request.param](folder)
    return repo, convert_main(["hf", "--model-dir", str(repo.path), "--output", str(folder / "out.safetensors")])


def ours(checkpoint: Path, image: Image.Image, labels: list[str], template: str = TEMPLATE) -> torch.Tensor:
    ckpt = load_checkpoint(checkpoint)
    assert ckpt.zero_shot is not None
    x = EvalTransform(ckpt.preprocessing)(image)[None]
    with torch.inference_mode():
        texts = ckpt.zero_shot.embed_texts(ckpt.zero_shot.prompts(labels, template))
        return ckpt.zero_shot.probabilities(ckpt.zero_shot.logits(ckpt.model(x), texts))[0]


def test_probabilities_equal_the_transformers_pipeline(converted: tuple[Repo, Path], photo: Image.Image) -> None:
    repo, checkpoint = converted
    for image in (photo, photo.rotate(90, expand=True).convert("L").convert("RGB")):
        theirs = pipeline_scores(repo, image, LABELS)
        assert theirs.max() - theirs.min() > 0.01  # the answers differ by label: the comparison means something
        torch.testing.assert_close(ours(checkpoint, image, LABELS), theirs, atol=1e-4, rtol=0)


def test_a_clip_saved_as_transformers_5_saves_it_equals_the_pipeline_loaded_from_its_folder(
    converted: tuple[Repo, Path], photo: Image.Image
) -> None:
    """CLIPProcessor.save_pretrained writes processor_config.json and no preprocessor_config.json: the converter
    reads the image processor from it (shortest edge, centre crop, bicubic, CLIP's mean and std), and the
    probabilities from JPEG and PNG files of other sizes equal transformers' pipeline loaded from the folder."""
    import io

    from transformers import pipeline

    repo, checkpoint = converted
    p = load_checkpoint(checkpoint).preprocessing
    if repo.model.config.model_type != "clip":
        assert (repo.path / "preprocessor_config.json").is_file()  # SigLIP: the image processor saved alone
        return
    assert not (repo.path / "preprocessor_config.json").exists() and (repo.path / "processor_config.json").is_file()
    assert (p.resize, p.interpolation, p.mean) == ("center_crop", "bicubic", (0.48145466, 0.4578275, 0.40821073))
    classify = pipeline("zero-shot-image-classification", model=str(repo.path))
    for kind, size in (("JPEG", (75, 40)), ("PNG", (33, 90))):
        encoded = io.BytesIO()
        photo.resize(size).save(encoded, format=kind)
        image = Image.open(io.BytesIO(encoded.getvalue())).convert("RGB")
        answers = {
            a["label"]: a["score"] for a in classify(image, candidate_labels=LABELS, hypothesis_template=TEMPLATE)
        }
        theirs = torch.tensor([answers[label] for label in LABELS])
        torch.testing.assert_close(ours(checkpoint, image, LABELS), theirs, atol=1e-4, rtol=0)


def test_the_template_and_the_order_of_labels_are_the_requests(
    converted: tuple[Repo, Path], photo: Image.Image
) -> None:
    repo, checkpoint = converted
    labels = ["dog", "cat", "a red car"]
    template = "This is a photo of {}."
    torch.testing.assert_close(
        ours(checkpoint, photo, labels, template), pipeline_scores(repo, photo, labels, template), atol=1e-4, rtol=0
    )
    forward, backward = ours(checkpoint, photo, labels), ours(checkpoint, photo, labels[::-1])
    torch.testing.assert_close(forward, backward.flip(0), atol=1e-6, rtol=0)


def test_the_tokenizer_travels_in_the_checkpoint_and_equals_transformers(converted: tuple[Repo, Path]) -> None:
    repo, checkpoint = converted
    tower = load_checkpoint(checkpoint).zero_shot
    assert tower is not None
    texts = [*tower.prompts(LABELS), "", "UPPER case, with: punctuation!?", "a " * 100, "emoji 🐈 and tabs\there"]
    context = tower.config.text.context_length  # a longer text is cut, its end-of-text token kept
    padding = "max_length" if tower.config.rule == "sigmoid" else True  # SigLIP reads the last position
    theirs = repo.tokenizer(texts, padding=padding, max_length=context, truncation=True)
    ids, lengths = tower.tokenizer(texts)
    assert ids.tolist() == theirs["input_ids"]
    assert lengths.tolist() == [sum(row) for row in theirs["attention_mask"]]


def test_the_rule_is_the_models_own(converted: tuple[Repo, Path], photo: Image.Image) -> None:
    repo, checkpoint = converted
    probabilities = ours(checkpoint, photo, LABELS)
    if repo.model.config.model_type == "clip":
        assert load_checkpoint(checkpoint).zero_shot.config.rule == "softmax"  # type: ignore[union-attr]
        assert probabilities.sum().item() == pytest.approx(1.0, abs=1e-5)
    else:  # SigLIP: each label on its own, so one label's answer does not depend on the others
        assert load_checkpoint(checkpoint).zero_shot.config.rule == "sigmoid"  # type: ignore[union-attr]
        alone = ours(checkpoint, photo, LABELS[:1])
        torch.testing.assert_close(alone, probabilities[:1], atol=1e-6, rtol=0)


def test_default_labels_come_from_a_file(converted: tuple[Repo, Path], tmp_path: Path) -> None:
    repo, _ = converted
    labels = tmp_path / "labels.txt"
    labels.write_text("cat\n\ndog\na red car\n", encoding="utf-8")
    out = convert_main(
        ["hf", "--model-dir", str(repo.path), "--labels", str(labels), "--output", str(tmp_path / "o.safetensors")]
    )
    assert load_checkpoint(out).classes == ["cat", "dog", "a red car"]
    labels.write_text("cat\ncat\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        convert_main(
            ["hf", "--model-dir", str(repo.path), "--labels", str(labels), "--output", str(tmp_path / "x.safetensors")]
        )


def test_the_text_tower_is_inside_the_content_hash(converted: tuple[Repo, Path], tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    _, checkpoint = converted
    tensors = load_file(str(checkpoint))
    with safe_open(str(checkpoint), framework="pt") as f:
        metadata = f.metadata()
    tensors["zero_shot.logit_scale"] = tensors["zero_shot.logit_scale"] + 1
    save_file(tensors, str(tmp_path / "tampered.safetensors"), metadata=metadata)
    with pytest.raises(CheckpointError, match="content hash mismatch"):
        load_checkpoint(tmp_path / "tampered.safetensors")


def test_reference_statistics_do_not_apply_to_a_zero_shot_model(converted: tuple[Repo, Path], tmp_path: Path) -> None:
    _, checkpoint = converted
    ckpt = load_checkpoint(checkpoint)
    dim = ckpt.config.dim
    reference = Reference(torch.zeros(2, dim), torch.eye(dim), torch.full((2,), 0.5), 2)
    with pytest.raises(ValueError, match="per class"):
        save_checkpoint(
            tmp_path / "x.safetensors",
            ckpt.model,
            [],
            ckpt.preprocessing,
            reference=reference,
            zero_shot=ckpt.zero_shot,
        )


@pytest.mark.parametrize("template", ["a photo", "{} and {}", "{0} {name}", "{"])
def test_a_template_needs_one_place_for_the_label(template: str) -> None:
    with pytest.raises(ValueError, match="template"):
        check_template(template)


@pytest.fixture(scope="module", params=["clip", "siglip"])
def open_clip_converted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Any, Path]:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp(f"open_clip-{request.param}")
    model, tokenizer, name = open_clip_model(folder, request.param)
    save_file(model.state_dict(), str(folder / "weights.safetensors"))
    out = convert_main(
        [
            "open_clip",
            "--arch",
            name,
            "--weights",
            str(folder / "weights.safetensors"),
            "--output",
            str(folder / "o.safetensors"),
        ]
    )
    return model, tokenizer, out


def test_open_clip_probabilities_equal_open_clips_own(
    open_clip_converted: tuple[Any, Any, Path], photo: Image.Image
) -> None:
    import open_clip

    model, tokenizer, checkpoint = open_clip_converted
    cfg = model.visual.preprocess_cfg
    transform = open_clip.image_transform(
        cfg["size"],
        is_train=False,
        mean=cfg["mean"],
        std=cfg["std"],
        resize_mode=cfg["resize_mode"],
        interpolation=cfg["interpolation"],
    )
    texts = [TEMPLATE.format(label) for label in LABELS]
    with torch.inference_mode():
        image = model.encode_image(transform(photo)[None], normalize=True)
        logits = image @ model.encode_text(tokenizer(texts), normalize=True).T * model.logit_scale.exp()
        bias = getattr(model, "logit_bias", None)
        theirs = (logits + bias).sigmoid()[0] if bias is not None else logits.softmax(dim=-1)[0]
    assert theirs.max() - theirs.min() > 0.01
    torch.testing.assert_close(ours(checkpoint, photo, LABELS), theirs, atol=1e-4, rtol=0)
    ids, _ = load_checkpoint(checkpoint).zero_shot.tokenizer(texts)  # type: ignore[union-attr]
    assert torch.equal(ids, tokenizer(texts)[:, : ids.shape[1]])  # open_clip pads every text to its context
    # its evaluation transform (create_model_and_transforms') ran on the same image files as the checkpoint's
    check = load_checkpoint(checkpoint).training["converted_from"]["preprocessing_check"]
    assert check["checked_images"] == 5 and check["max_pixel_levels"] <= MAX_PIXEL_LEVELS


def test_class_statistics_and_evaluation_refuse_a_zero_shot_model(
    converted: tuple[Repo, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from model.evaluate import main as evaluate_main
    from model.reference.__main__ import main as reference_main

    _, checkpoint = converted
    with pytest.raises(SystemExit) as refused:
        reference_main([str(checkpoint), "--shapes", "10"])
    assert refused.value.code == 2 and "zero-shot model" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="zero-shot model"):
        evaluate_main(["--checkpoint", str(checkpoint), "--samples", "10"])


def test_the_check_catches_a_wrong_text_tower(converted: tuple[Repo, Path]) -> None:
    from model.convert.converted import ConversionError, check_equal
    from model.convert.hf_clip import convert_hf_clip

    repo, _ = converted
    source = convert_hf_clip(repo.path)
    check_equal(source.build(), source)
    source.zero_shot_state["text.norm.weight"] = source.zero_shot_state["text.norm.weight"] * 1.01
    with pytest.raises(ConversionError, match="differ"):
        check_equal(source.build(), source)


def test_a_siglip_with_a_tokenizer_json_as_siglip_2_ships_equals_the_pipeline(
    tmp_path: Path, photo: Image.Image
) -> None:
    """SigLIP 2's fixed-resolution checkpoints are SiglipModel with a tokenizer.json (Gemma's byte-fallback BPE),
    carried by the `tokenizers` path with SigLIP's padding to 64."""
    repo = siglip2_repo(tmp_path)
    checkpoint = convert_main(["hf", "--model-dir", str(repo.path), "--output", str(tmp_path / "s2.safetensors")])
    ckpt = load_checkpoint(checkpoint)
    assert ckpt.zero_shot is not None and ckpt.zero_shot.config.tokenizer.kind == "tokenizers"
    theirs = pipeline_scores(repo, photo, LABELS)
    assert theirs.max() - theirs.min() > 0.01
    torch.testing.assert_close(ours(checkpoint, photo, LABELS), theirs, atol=1e-4, rtol=0)
