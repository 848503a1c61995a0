"""Teaching heads over the API, in process: POST /v1/models/{name}/heads/{head} from a multipart body or a folder of
the model repository, the head answering at once and kept beside the checkpoint (back after a restart), replaced
only when asked, deleted; every bad lesson refused with its reason and nothing taught before lost."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest
import torch

from harness.images import encode
from model.shapes_second import make_sample
from model.taught_head import load
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.clients import ClientFactory

CLASSES = {"round": 0, "donut": 7, "pointy": 5}  # the second renderer's circles, rings and stars


@functools.cache
def pngs(label: int, count: int, start: int = 0) -> list[bytes]:
    """`count` PNGs of the second renderer's class `label`, from sample `start` on."""
    found: list[bytes] = []
    i = start
    while len(found) < count:
        sample = make_sample(808, i)
        i += 1
        if sample.label == label:
            found.append(encode(sample.image.convert("RGB")))
    return found


def lesson(per_class: int = 4, classes: dict[str, int] = CLASSES) -> list[tuple[str, tuple[str, bytes, str]]]:
    """A multipart body's files: `per_class` images of each class under its name."""
    return [
        (name, (f"{name}{i}.png", png, "image/png"))
        for name, label in classes.items()
        for i, png in enumerate(pngs(label, per_class))
    ]


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_checkpoint(folder / "shapes.safetensors", seed=0)
    return folder


def serving(make_client: ClientFactory, repository: Path, **settings: object):  # type: ignore[no-untyped-def]
    return make_client(model_repository=repository, models="shapes", cache_bytes=1_000_000, warmup=False, **settings)


async def predict(client: httpx.AsyncClient, png: bytes, **params: str) -> httpx.Response:
    return await client.post("/predict", params=params, files={"file": ("a.png", png, "image/png")})


async def test_a_head_taught_over_the_api_answers_at_once_is_kept_and_comes_back(
    make_client: ClientFactory, repository: Path
) -> None:
    probe = pngs(7, 1, start=400)[0]
    async with serving(make_client, repository) as client:
        r = await client.post("/v1/models/shapes/heads/mine", files=lesson())
        assert r.status_code == 201, r.text
        taught = r.json()
        assert taught["name"] == "mine" and taught["model"]["name"] == "shapes"
        assert taught["classes"] == list(CLASSES) and taught["examples"] == dict.fromkeys(CLASSES, 4)
        assert taught["estimate"]["method"] == "leave-one-out" and taught["estimate"]["examples"] == 12
        assert taught["embedding"] == "pre-logits" and taught["rule"] in ("means", "logistic")

        r = await predict(client, probe, head="mine", embedding="true")
        assert r.status_code == 200, r.text
        result = r.json()["results"][0]
        top = max(range(len(CLASSES)), key=lambda k: result["probabilities"][k])
        assert result["top_k"][0]["label"] == list(CLASSES)[top] and len(result["probabilities"]) == len(CLASSES)
        # the head's file, beside the checkpoint in the repository, gives the embedding the server returned
        head = load(repository / "heads" / "shapes" / "mine.safetensors")
        expected = head.probabilities(torch.tensor([result["embedding"]]))[0]
        torch.testing.assert_close(torch.tensor(result["probabilities"]), expected, atol=1e-5, rtol=0)
        listed = (await client.get("/v1/models/shapes/heads")).json()["heads"]
        assert [h["name"] for h in listed] == ["mine"] and listed[0]["examples"] == taught["examples"]
        before = result["probabilities"]
    async with serving(make_client, repository) as client:  # a restart: the head comes back with the repository
        r = await predict(client, probe, head="mine")
        assert r.status_code == 200 and r.json()["results"][0]["probabilities"] == pytest.approx(before, abs=1e-5)


async def test_a_taken_name_is_refused_unless_replaced_and_the_cache_answers_the_new_head(
    make_client: ClientFactory, repository: Path
) -> None:
    probe = pngs(0, 1, start=400)[0]
    async with serving(make_client, repository) as client:
        assert (await client.post("/v1/models/shapes/heads/mine", files=lesson())).status_code == 201
        first = (await predict(client, probe, head="mine")).json()["results"][0]
        r = await client.post("/v1/models/shapes/heads/mine", files=lesson(classes={"a": 0, "b": 7}))
        assert r.status_code == 409, r.text
        assert "already has a head named 'mine'" in r.json()["detail"] and "replace=true" in r.json()["detail"]
        assert (await predict(client, probe, head="mine")).json()["results"][0] == first  # untouched

        r = await client.post("/v1/models/shapes/heads/mine?replace=true", files=lesson(classes={"a": 0, "b": 7}))
        assert r.status_code == 201, r.text
        again = (await predict(client, probe, head="mine")).json()
        assert again["head"] == "mine" and len(again["results"][0]["probabilities"]) == 2  # not the cached answer
        assert {c["label"] for c in again["results"][0]["top_k"]} == {"a", "b"}


async def test_a_deleted_head_is_gone_from_answers_listing_and_disk(
    make_client: ClientFactory, repository: Path, shape_png: bytes
) -> None:
    async with serving(make_client, repository) as client:
        assert (await client.post("/v1/models/shapes/heads/mine", files=lesson(2))).status_code == 201
        assert (await client.post("/v1/models/shapes/heads/other", files=lesson(2))).status_code == 201
        r = await client.delete("/v1/models/shapes/heads/mine")
        assert r.status_code == 204, r.text
        assert not (repository / "heads" / "shapes" / "mine.safetensors").exists()
        r = await predict(client, shape_png, head="mine")
        assert r.status_code == 404 and "has no head named 'mine'; its heads: other" in r.json()["detail"]
        assert [h["name"] for h in (await client.get("/v1/models/shapes/heads")).json()["heads"]] == ["other"]
        r = await client.delete("/v1/models/shapes/heads/mine")
        assert r.status_code == 404 and "no head named 'mine'" in r.json()["detail"]
        assert (await client.delete("/v1/models/nothing/heads/other")).status_code == 404
        assert (await predict(client, shape_png, head="other")).status_code == 200


async def test_a_folder_of_the_repository_teaches_one(make_client: ClientFactory, repository: Path) -> None:
    for name, label in CLASSES.items():
        (repository / "examples" / "parts" / name).mkdir(parents=True)
        for i, png in enumerate(pngs(label, 3)):
            (repository / "examples" / "parts" / name / f"{i}.png").write_bytes(png)
    (repository / "examples" / "parts" / "round" / "notes.txt").write_text("not an image")
    async with serving(make_client, repository) as client:
        r = await client.post("/v1/models/shapes/heads/parts", params={"folder": "examples/parts", "rule": "means"})
        assert r.status_code == 201, r.text
        assert r.json()["examples"] == {"donut": 3, "pointy": 3, "round": 3} and r.json()["rule"] == "means"
        for folder, message in [
            ("../", "is not inside the model repository"),
            ("/etc", "is not inside the model repository"),
            ("examples/none", "no folder 'examples/none' in the model repository"),
        ]:
            r = await client.post("/v1/models/shapes/heads/x", params={"folder": folder})
            assert r.status_code == 422 and message in r.json()["detail"], r.text
    async with make_client() as client:  # no repository: nothing to name a folder of
        r = await client.post("/v1/models/tiny/heads/x", params={"folder": "examples"})
        assert r.status_code == 400 and "this server has none" in r.json()["detail"], r.text


def broken(files: list[tuple[str, tuple[str, bytes, str]]]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [*files[:-1], (files[-1][0], ("scan.png", b"not an image at all", "image/png"))]


@pytest.mark.parametrize(
    ("path", "params", "files", "status", "message"),
    [
        ("shapes/heads/x", {}, lesson(2, {"round": 0}), 422, "send images of at least two classes"),
        (
            "shapes/heads/x",
            {},
            [*lesson(2, {"round": 0}), ("ring", ("", b"", "application/octet-stream"))],
            422,
            "class 'ring' has no image",
        ),
        ("shapes/heads/x", {}, broken(lesson(2)), 415, "class 'pointy': scan.png: not a recognised image"),
        ("shapes/heads/..x", {}, lesson(2), 422, "is not a head name"),
        ("shapes/heads/x", {"rule": "knn"}, lesson(2), 422, "rule"),
        ("shapes/heads/x", {"colour": "red"}, lesson(2), 422, "colour"),
        ("nothing/heads/x", {}, lesson(2), 404, "no model named 'nothing'"),
        ("shapes/heads/mine", {}, lesson(2), 409, "already has a head named 'mine'"),
    ],
)
async def test_a_bad_lesson_is_refused_with_its_reason_and_nothing_taught_is_lost(
    make_client: ClientFactory, repository: Path, shape_png: bytes, path: str, params: dict[str, str],
    files: list[tuple[str, tuple[str, bytes, str]]], status: int, message: str,
) -> None:  # fmt: skip
    async with serving(make_client, repository) as client:
        assert (await client.post("/v1/models/shapes/heads/mine", files=lesson(2))).status_code == 201
        before = (await predict(client, shape_png, head="mine")).json()
        r = await client.post(f"/v1/models/{path}", params=params, files=files)
        assert r.status_code == status and message in r.text, r.text
        assert [h["name"] for h in (await client.get("/v1/models/shapes/heads")).json()["heads"]] == ["mine"]
        assert (await predict(client, shape_png, head="mine")).json() == before
        assert sorted(p.name for p in (repository / "heads" / "shapes").iterdir()) == ["mine.safetensors"]


async def test_the_settings_cap_examples_and_can_turn_teaching_off(
    make_client: ClientFactory, repository: Path
) -> None:
    async with serving(make_client, repository, teach_max_examples=5) as client:
        r = await client.post("/v1/models/shapes/heads/x", files=lesson(2))
        assert r.status_code == 422 and "Maximum number of files is 5" in r.json()["detail"], r.text
        assert (await client.post("/v1/models/shapes/heads/x", files=lesson(1))).status_code == 201
    async with serving(make_client, repository, teach_max_examples=0) as client:
        r = await client.post("/v1/models/shapes/heads/y", files=lesson(1))
        assert r.status_code == 400 and "VIT_TEACH_MAX_EXAMPLES=0" in r.json()["detail"], r.text
        assert (await client.delete("/v1/models/shapes/heads/x")).status_code == 204
    async with serving(make_client, repository, teach_max_bytes=1000) as client:
        r = await client.post("/v1/models/shapes/heads/x", files=lesson(2))
        assert r.status_code == 413, r.text
        r = await client.post("/v1/models/shapes/heads/x", content=b"{}", headers={"content-type": "application/json"})
        assert r.status_code == 415 and "multipart/form-data" in r.json()["detail"], r.text


async def test_teaching_needs_the_api_key(make_client: ClientFactory, repository: Path) -> None:
    async with serving(make_client, repository, api_keys="k") as client:
        assert (await client.post("/v1/models/shapes/heads/x", files=lesson(1))).status_code == 401
        assert (await client.delete("/v1/models/shapes/heads/x")).status_code == 401
        r = await client.post("/v1/models/shapes/heads/x", files=lesson(1), headers={"x-api-key": "k"})
        assert r.status_code == 201, r.text


async def test_a_heads_folder_that_cannot_be_written_refuses_the_head_and_keeps_serving(
    make_client: ClientFactory, repository: Path, shape_png: bytes
) -> None:
    (repository / "heads").write_text("a file where the heads folder would go")
    async with serving(make_client, repository) as client:
        r = await client.post("/v1/models/shapes/heads/x", files=lesson(1))
        assert r.status_code == 400, r.text
        assert (
            r.json()["detail"]
            == "model shapes's heads folder cannot be written (Not a directory); head 'x' was not kept"
        )
        assert (await client.get("/v1/models/shapes/heads")).json()["heads"] == []
        assert (await predict(client, shape_png, head="x")).status_code == 404
        assert (await predict(client, shape_png)).status_code == 200
