"""CLIP and SigLIP served zero-shot through /predict, in process: the classes are the labels a request names, and
the probabilities equal transformers' zero-shot pipeline and open_clip's own computation on the same file."""

from __future__ import annotations

import asyncio
import io
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image

from harness.images import encode
from model.convert.__main__ import main as convert_main
from model.taught_head import load
from tests.support.clients import ClientFactory, until
from tests.support.zero_shot import LABELS, TEMPLATE, Repo, clip_repo, open_clip_model, pipeline_scores, siglip_repo

pytestmark = pytest.mark.slow  # builds, converts and serves transformers models

REPOS: dict[str, Callable[[Path], Repo]] = {"clip": clip_repo, "siglip": siglip_repo}

ATOL = 1e-4


@pytest.fixture(scope="module", params=["clip", "siglip"])
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Repo, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    repo = REPOS[request.param](folder)
    return repo, convert_main(["hf", "--model-dir", str(repo.path), "--output", str(folder / "out.safetensors")])


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Repo, Path]:
    folder = tmp_path_factory.mktemp("clip")
    repo = clip_repo(folder)
    return repo, convert_main(["hf", "--model-dir", str(repo.path), "--output", str(folder / "clip.safetensors")])


async def predict(client: httpx.AsyncClient, png: bytes, **params: Any) -> httpx.Response:
    return await client.post("/predict", files={"file": ("photo.png", png, "image/png")}, params=params)


def probabilities(r: httpx.Response, image: int = 0) -> torch.Tensor:
    assert r.status_code == 200, r.text
    return torch.tensor(r.json()["results"][image]["probabilities"])


def text_passes(metrics: str, model: str) -> float:
    found = re.search(rf'^vit_text_embeddings_total{{model="{model}"}} (\S+)$', metrics, re.M)
    assert found is not None, metrics
    return float(found.group(1))


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
async def test_served_probabilities_equal_the_transformers_pipeline(
    make_client: ClientFactory, converted: tuple[Repo, Path], photo: Image.Image, backend: str
) -> None:
    repo, checkpoint = converted
    png = encode(photo)
    theirs = pipeline_scores(repo, Image.open(io.BytesIO(png)).convert("RGB"), LABELS)
    assert theirs.max() - theirs.min() > 0.01  # the answers differ by label: the comparison means something
    async with make_client(weights=checkpoint, backend=backend) as client:
        r = await predict(client, png, labels=",".join(LABELS[:3]), label=LABELS[3:], top_k=2)
        info = (await client.get("/v1/model")).json()
    torch.testing.assert_close(probabilities(r), theirs, atol=ATOL, rtol=0)
    top = r.json()["results"][0]["top_k"]
    best = int(theirs.argmax())
    assert top[0] == {"label": LABELS[best], "index": best, "probability": pytest.approx(float(theirs[best]), abs=ATOL)}
    rule = "softmax" if "clip" in str(checkpoint.parent.name) else "sigmoid"
    assert info["zero_shot"] == {"rule": rule, "template": TEMPLATE} and info["classes"] == []
    assert r.json()["zero_shot"] == {"rule": rule, "template": TEMPLATE}  # the answer says how it was computed
    assert info["backend"] == backend


async def test_open_clip_served_probabilities_equal_open_clips_own(
    make_client: ClientFactory, tmp_path: Path, photo: Image.Image
) -> None:
    import open_clip
    from safetensors.torch import save_file

    model, tokenizer, name = open_clip_model(tmp_path, "clip")
    save_file(model.state_dict(), str(tmp_path / "weights.safetensors"))
    weights, out = str(tmp_path / "weights.safetensors"), str(tmp_path / "o.safetensors")
    checkpoint = convert_main(["open_clip", "--arch", name, "--weights", weights, "--output", out])
    png = encode(photo)
    cfg = model.visual.preprocess_cfg
    transform = open_clip.image_transform(
        cfg["size"], is_train=False, mean=cfg["mean"], std=cfg["std"], resize_mode=cfg["resize_mode"]
    )
    with torch.inference_mode():
        image = model.encode_image(transform(Image.open(io.BytesIO(png)).convert("RGB"))[None], normalize=True)
        texts = model.encode_text(tokenizer([TEMPLATE.format(label) for label in LABELS]), normalize=True)
        theirs = (image @ texts.T * model.logit_scale.exp()).softmax(dim=-1)[0]
    assert theirs.max() - theirs.min() > 0.01
    async with make_client(weights=checkpoint) as client:
        r = await predict(client, png, label=LABELS)  # every label whole, commas and all
    torch.testing.assert_close(probabilities(r), theirs, atol=ATOL, rtol=0)
    assert r.json()["results"][0]["top_k"][0]["label"] == LABELS[int(theirs.argmax())]


async def test_labels_are_parsed_in_order_and_templates_change_the_answer(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image
) -> None:
    repo, checkpoint = clip
    png = encode(photo)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    async with make_client(weights=checkpoint) as client:
        spaced = await predict(client, png, labels=" cat , dog,a red car ", top_k=3)
        repeated = await predict(client, png, labels="cat", label=["dog", "Hello, World!"], top_k=3)
        templated = await predict(client, png, labels="cat,dog", template="a drawing of {}")
    assert [t["label"] for t in sorted(spaced.json()["results"][0]["top_k"], key=lambda t: t["index"])] == [
        "cat",
        "dog",
        "a red car",
    ]
    torch.testing.assert_close(
        probabilities(spaced), pipeline_scores(repo, image, ["cat", "dog", "a red car"]), atol=ATOL, rtol=0
    )
    expected = pipeline_scores(repo, image, ["cat", "dog", "Hello, World!"])
    torch.testing.assert_close(probabilities(repeated), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        probabilities(templated), pipeline_scores(repo, image, ["cat", "dog"], "a drawing of {}"), atol=ATOL, rtol=0
    )
    assert templated.json()["zero_shot"]["template"] == "a drawing of {}"


@pytest.mark.parametrize(
    ("params", "says"),
    [
        # in words true of both protocols: /predict's query and V2's parameter
        (
            {},
            "no default labels: name the classes to choose among (/predict: labels=cat,dog or a repeated label=; "
            "V2: the request parameter labels)",
        ),
        ({"labels": ""}, "the labels name no class: give at least one"),
        ({"labels": " , "}, "the labels name no class: give at least one"),
        ({"labels": "cat,,dog"}, "an empty label among 3"),
        ({"labels": "cat,dog,cat"}, "label 'cat' is named twice"),
        ({"labels": "cat", "template": "no place"}, "must hold one {}"),
        ({"labels": "cat", "template": "{} and {}"}, "must hold one {}"),
        ({"labels": "cat,dog", "attention": "gradient", "target": "bird"}, "target 'bird' names no class"),
        ({"labels": "cat", "ood": "true"}, "zero-shot"),
    ],
)
async def test_what_a_zero_shot_model_cannot_answer_is_a_422_that_says_why(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image, params: dict[str, str], says: str
) -> None:
    async with make_client(weights=clip[1]) as client:
        r = await predict(client, encode(photo), **params)
    assert r.status_code == 422, r.text
    assert says in r.json()["detail"]


async def test_a_request_refused_for_its_options_embeds_no_labels(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image
) -> None:
    """An out-of-distribution score asked of a zero-shot model is refused before the request's labels reach the
    text tower: no work is spent on an answer nobody gets."""
    async with make_client(weights=clip[1]) as client:
        name = (await client.get("/v1/model")).json()["name"]
        before = text_passes((await client.get("/metrics")).text, name)
        r = await predict(client, encode(photo), labels="a heron,a kettle,a violin", ood="true")
        after = text_passes((await client.get("/metrics")).text, name)
    assert r.status_code == 422 and "zero-shot" in r.json()["detail"], r.text
    assert after == before


async def test_a_classifier_refuses_labels(client: httpx.AsyncClient, photo: Image.Image) -> None:
    """Each parameter is told what it is for: labels name classes, a template is a prompt."""
    for params, says in (
        ({"labels": "cat,dog"}, "labels name the classes of a zero-shot model"),
        ({"label": "cat"}, "labels name the classes of a zero-shot model"),
        ({"template": "a {}"}, "a template is the prompt a zero-shot model (CLIP, SigLIP) sets each label in"),
    ):
        r = await predict(client, encode(photo), **params)
        detail = r.json()["detail"]
        assert r.status_code == 422 and says in detail and "is a classifier with fixed classes" in detail, r.text


async def test_default_labels_answer_a_request_that_names_none(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image, tmp_path: Path
) -> None:
    repo, _ = clip
    (tmp_path / "labels.txt").write_text("cat\ndog\na red car\n", encoding="utf-8")
    labels, out = str(tmp_path / "labels.txt"), str(tmp_path / "labelled.safetensors")
    checkpoint = convert_main(["hf", "--model-dir", str(repo.path), "--labels", labels, "--output", out])
    png = encode(photo)
    async with make_client(weights=checkpoint) as client:
        default = await predict(client, png)
        named = await predict(client, png, labels="dog,cat")
        info = (await client.get("/v1/model")).json()
    assert info["classes"] == ["cat", "dog", "a red car"]
    image = Image.open(io.BytesIO(png)).convert("RGB")
    torch.testing.assert_close(probabilities(default), pipeline_scores(repo, image, info["classes"]), atol=ATOL, rtol=0)
    torch.testing.assert_close(probabilities(named), pipeline_scores(repo, image, ["dog", "cat"]), atol=ATOL, rtol=0)


async def test_label_embeddings_are_computed_once_and_kept(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image
) -> None:
    png = encode(photo)
    async with make_client(weights=clip[1]) as client:
        name = (await client.get("/v1/model")).json()["name"]
        before = text_passes((await client.get("/metrics")).text, name)
        first = await predict(client, png, labels="cat,dog,a red car")
        after_first = text_passes((await client.get("/metrics")).text, name)
        again = await predict(client, png, labels="cat,dog,a red car")
        reordered = await predict(client, png, labels="a red car,cat")
        after_again = text_passes((await client.get("/metrics")).text, name)
        one_more = await predict(client, png, labels="cat,dog,x")
        after_one_more = text_passes((await client.get("/metrics")).text, name)
        other_template = await predict(client, png, labels="cat", template="{}")
        last = text_passes((await client.get("/metrics")).text, name)
    assert (after_first - before, after_again - after_first, after_one_more - after_again, last - after_one_more) == (
        3,
        0,
        1,
        1,
    )
    torch.testing.assert_close(probabilities(first), probabilities(again))
    assert probabilities(reordered).shape == (2,) and other_template.status_code == 200
    assert one_more.status_code == 200


async def test_requests_with_different_labels_share_a_batch(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image
) -> None:
    repo, checkpoint = clip
    png = encode(photo)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    sets = [["cat", "dog"], ["a red car", "x", "cat"], ["café au lait"]]
    async with make_client(weights=checkpoint, max_batch_size=8) as client:
        name = (await client.get("/v1/model")).json()["name"]
        for labels in sets:  # their text passes done beforehand
            await predict(client, png, label=labels)
        batches = (await client.get(f"/v2/models/{name}/stats")).json()["model_stats"][0]["execution_count"]
        model = client.app.state.data_plane.model(None)  # type: ignore[attr-defined]
        released, under_way, original = threading.Event(), threading.Event(), model.batcher.run_batch

        def held(batch: list[Any]) -> Any:  # the forward thread waits while the three requests queue
            under_way.set()
            released.wait(30)
            return original(batch)

        model.batcher.run_batch = held
        first = asyncio.create_task(predict(client, png, labels="cat"))
        await until(under_way.is_set)
        asked = asyncio.gather(*(predict(client, png, label=labels) for labels in sets))
        await until(lambda: model.batcher.queue_depth == len(sets))
        released.set()
        answers, _ = await asked, await first
        after = (await client.get(f"/v2/models/{name}/stats")).json()["model_stats"][0]["execution_count"]
    assert after - batches == 2  # the held batch, then three requests with three label sets in one forward pass
    for labels, r in zip(sets, answers, strict=True):
        torch.testing.assert_close(probabilities(r), pipeline_scores(repo, image, labels), atol=ATOL, rtol=0)


async def test_gradient_maps_follow_the_named_label(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image
) -> None:
    png = encode(photo)
    async with make_client(weights=clip[1]) as client:
        maps = {}
        for target in ("cat", "a red car"):
            r = await predict(client, png, labels="cat,dog,a red car", attention="gradient", target=target)
            assert r.status_code == 200, r.text
            maps[target] = torch.tensor(r.json()["results"][0]["attention"]["map"])
        top1 = await predict(client, png, labels="cat,dog,a red car", attention="gradient")
        rollout = await predict(client, png, labels="cat,dog", attention="rollout")
    assert maps["cat"].shape == (4, 4) and float(maps["cat"].max()) == 1.0
    assert not torch.allclose(maps["cat"], maps["a red car"], atol=1e-3)  # a map of each label's own score
    best = top1.json()["results"][0]["top_k"][0]["label"]
    torch.testing.assert_close(torch.tensor(top1.json()["results"][0]["attention"]["map"]), maps[best])
    assert rollout.json()["results"][0]["attention"]["method"] == "rollout"


async def test_the_embedding_is_the_images_in_the_joint_space(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image
) -> None:
    repo, checkpoint = clip
    png = encode(photo)
    pixels = repo.processor(Image.open(io.BytesIO(png)).convert("RGB"), return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        theirs = repo.model.get_image_features(pixel_values=pixels)
        theirs = (theirs if isinstance(theirs, torch.Tensor) else theirs.pooler_output)[0]
    async with make_client(weights=checkpoint) as client:
        raw = await predict(client, png, labels="cat", embedding="true")
        unit = await predict(client, png, labels="cat", embedding="true", normalize="true")
    assert raw.status_code == 200 and unit.status_code == 200, (raw.text, unit.text)
    torch.testing.assert_close(torch.tensor(raw.json()["results"][0]["embedding"]), theirs, atol=ATOL, rtol=0)
    normalised = torch.nn.functional.normalize(theirs, dim=0)
    torch.testing.assert_close(torch.tensor(unit.json()["results"][0]["embedding"]), normalised, atol=ATOL, rtol=0)


async def test_the_response_cache_keeps_answers_by_their_labels_and_template(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image
) -> None:
    png = encode(photo)
    async with make_client(weights=clip[1], cache_bytes=1 << 20) as client:
        first = probabilities(await predict(client, png, labels="cat,dog"))
        swapped = probabilities(await predict(client, png, labels="dog,cat"))
        templated = probabilities(await predict(client, png, labels="cat,dog", template="{}"))
        again = probabilities(await predict(client, png, labels="cat,dog"))
    torch.testing.assert_close(swapped, first.flip(0))
    assert not torch.allclose(templated, first, atol=1e-4)
    torch.testing.assert_close(again, first)


async def test_a_head_taught_on_a_zero_shot_model_without_labels_reads_its_joint_embeddings(
    make_client: ClientFactory, clip: tuple[Repo, Path], photo: Image.Image, tmp_path: Path
) -> None:
    """A CLIP with no default labels answers with a head's classes (no labels asked), over the image's joint-space
    embedding, the same vector `embedding=true` gives."""
    _, checkpoint = clip
    repository = tmp_path / "models"
    repository.mkdir()
    shutil.copy(checkpoint, repository / "clip.safetensors")
    crops = {
        "whole": [photo, photo.crop((0, 0, 200, 200))],
        "corner": [photo.crop((100, 100, 300, 300)), photo.crop((50, 150, 250, 350))],
    }
    files = [(name, (f"{name}{i}.png", encode(image), "image/png")) for name, images in crops.items()
             for i, image in enumerate(images)]  # fmt: skip
    async with make_client(model_repository=repository, models="clip") as client:
        r = await client.post("/v1/models/clip/heads/crops", files=files)
        assert r.status_code == 201, r.text
        assert r.json()["embedding"] == "joint" and r.json()["classes"] == ["whole", "corner"]
        r = await predict(client, encode(photo), model="clip", head="crops", embedding="true")
        assert r.status_code == 200, r.text
        result = r.json()["results"][0]
        head = load(repository / "heads" / "clip" / "crops.safetensors")
        expected = head.probabilities(torch.tensor([result["embedding"]]))[0]
        torch.testing.assert_close(torch.tensor(result["probabilities"]), expected, atol=1e-5, rtol=0)
        plain = await predict(client, encode(photo), model="clip")  # no head, no labels: nothing to answer with
        assert plain.status_code == 422 and "no default labels" in plain.json()["detail"]
