"""Heads taught by example, served: a head taught offline on the bundled model's backbone and kept beside its
checkpoint answers through /predict and the Open Inference Protocol's real clients over HTTP and gRPC, with serving
processes and with one, with the probabilities the head gives the backbone's embeddings; one taught over REST answers
at once at every front-end until deleted; a head taught on another backbone is not loaded; what a head cannot be
asked with is refused."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from PIL import Image
from tritonclient.utils import InferenceServerException

from app.settings import BUNDLED_WEIGHTS
from harness.images import encode
from harness.server import Server
from model.checkpoint import load_checkpoint
from model.preprocessing import EvalTransform
from model.shapes_second import make_sample
from model.taught_head import TaughtHead, fit, load, save
from model.teach import embed, head_path
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
# The head scales cosines by tens: the last digits of a batched forward's embeddings (1e-6) move its probabilities
# by up to 1e-3. Against the embeddings the server returns, the head's probabilities are exact.
ATOL = 2e-3
EXACT = 1e-5
TAUGHT = {"round": 0, "donut": 7, "pointy": 5}  # circles, rings and stars, named as a user names their own


def shapes(label: int, count: int, start: int) -> list[Image.Image]:
    """`count` images of the second renderer's class `label`, from sample `start` on."""
    found: list[Image.Image] = []
    i = start
    while len(found) < count:
        sample = make_sample(808, i)
        i += 1
        if sample.label == label:
            found.append(sample.image.convert("RGB"))
    return found


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled checkpoint as model `shapes`, a head `mine` taught on it from six images a class, and a head
    `stale` taught on another backbone, both where the service looks for them."""
    folder = tmp_path_factory.mktemp("heads")
    shutil.copy(BUNDLED_WEIGHTS, folder / "shapes.safetensors")
    ckpt = load_checkpoint(folder / "shapes.safetensors")
    transform = EvalTransform(ckpt.preprocessing)
    pixels = [transform(image) for label in TAUGHT.values() for image in shapes(label, 6, 0)]
    labels = [i for i in range(len(TAUGHT)) for _ in range(6)]
    head = fit(embed(ckpt, iter([torch.stack(pixels)])), labels, list(TAUGHT), ckpt.content_hash)
    save(head, head_path(folder / "shapes.safetensors", "mine"))
    stale = fit(torch.randn(6, head.dim), [0, 0, 0, 1, 1, 1], ["x", "y"], "0" * 64)
    save(stale, head_path(folder / "shapes.safetensors", "stale"))
    return folder


@pytest.fixture(scope="module")
def expected(folder: Path) -> tuple[list[bytes], torch.Tensor, TaughtHead]:
    """Images it was not taught with, as PNGs, and the probabilities the head gives their embeddings here."""
    ckpt = load_checkpoint(folder / "shapes.safetensors")
    head = load(head_path(folder / "shapes.safetensors", "mine"), ckpt.content_hash)
    images = [image for label in TAUGHT.values() for image in shapes(label, 2, 500)]
    pngs = [encode(image) for image in images]
    transform = EvalTransform(ckpt.preprocessing)
    decoded = [transform(Image.open(io.BytesIO(png)).convert("RGB")) for png in pngs]
    return pngs, head.probabilities(embed(ckpt, iter([torch.stack(decoded)]))), head


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "workers-2"])
def server(request: pytest.FixtureRequest, serve: ServerFactory, folder: Path) -> Server:
    return serve(folder / "shapes.safetensors", VIT_WORKERS=request.param, VIT_CACHE_BYTES="1000000")


def test_predict_answers_with_the_heads_classes(
    server: Server, expected: tuple[list[bytes], torch.Tensor, TaughtHead]
) -> None:
    pngs, probabilities, head = expected
    files = [("file", (f"{i}.png", png, "image/png")) for i, png in enumerate(pngs)]
    for _ in range(2):  # the second from the response cache, which keeps a head's answers apart from the model's
        params = {"head": "mine", "top_k": 3, "embedding": "true"}
        r = httpx.post(server.url + "/predict", params=params, files=files, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["head"] == "mine" and body["model"]["name"] == "shapes" and "zero_shot" not in body
        got = torch.tensor([result["probabilities"] for result in body["results"]])
        embeddings = torch.tensor([result["embedding"] for result in body["results"]])  # the backbone's pre-logits
        torch.testing.assert_close(got, head.probabilities(embeddings), atol=EXACT, rtol=0)
        torch.testing.assert_close(got, probabilities, atol=ATOL, rtol=0)
        assert [res["top_k"][0]["label"] for res in body["results"]] == [c for c in TAUGHT for _ in range(2)]
        plain = httpx.post(server.url + "/predict", files=files[:1], timeout=60).json()
        assert len(plain["results"][0]["probabilities"]) == 10 and "head" not in plain
    assert head.classes == tuple(TAUGHT)


def test_the_open_inference_protocol_takes_the_parameter_head_over_http_and_grpc(
    server: Server, expected: tuple[list[bytes], torch.Tensor, TaughtHead]
) -> None:
    pngs, probabilities, _ = expected
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        tensor = triton_http.InferInput("image", [len(pngs)], "BYTES")
        tensor.set_data_from_numpy(np.array(pngs, dtype=np.object_), binary_data=True)
        result = http.infer("shapes", [tensor], parameters={"head": "mine"})
    finally:
        http.close()
    assert result.get_response()["parameters"] == {"head": "mine"}
    torch.testing.assert_close(torch.tensor(result.as_numpy("probabilities")), probabilities, atol=ATOL, rtol=0)
    grpc = triton_grpc.InferenceServerClient(server.grpc_target)
    try:
        tensor = triton_grpc.InferInput("image", [len(pngs)], "BYTES")
        tensor.set_data_from_numpy(np.array(pngs, dtype=np.object_))
        asked = [triton_grpc.InferRequestedOutput("probabilities", class_count=1)]
        ranked = grpc.infer("shapes", [tensor], outputs=asked, parameters={"head": "mine"})
        plain = grpc.infer("shapes", [tensor], parameters={"head": "mine"})
    finally:
        grpc.close()
    torch.testing.assert_close(torch.tensor(plain.as_numpy("probabilities")), probabilities, atol=ATOL, rtol=0)
    labels = [entry[0].decode().split(":", 2)[2] for entry in ranked.as_numpy("probabilities")]
    assert labels == [c for c in TAUGHT for _ in range(2)]


def test_the_heads_are_listed_and_one_taught_on_another_backbone_is_not_loaded(
    server: Server, expected: tuple[list[bytes], torch.Tensor, TaughtHead]
) -> None:
    _, _, head = expected
    r = httpx.get(server.url + "/v1/models/shapes/heads", timeout=10)
    assert r.status_code == 200, r.text
    listed = r.json()
    assert listed["model"]["name"] == "shapes" and [h["name"] for h in listed["heads"]] == ["mine"]
    mine = listed["heads"][0]
    assert mine["classes"] == list(TAUGHT) and mine["examples"] == dict.fromkeys(TAUGHT, 6)
    assert mine["rule"] == head.rule and mine["embedding"] == "pre-logits"
    assert head.estimate is not None and mine["estimate"] == head.estimate.to_dict()
    log = server.read_output()
    assert (
        "head stale not loaded: head stale.safetensors was taught on the backbone with content hash 000000000000" in log
    )
    assert httpx.get(server.url + "/v1/models/nothing/heads", timeout=10).status_code == 404


@pytest.mark.parametrize(
    ("params", "status", "message"),
    [
        ({"head": "nope"}, 404, "model shapes has no head named 'nope'; its heads: mine"),
        ({"head": "stale"}, 404, "has no head named 'stale'"),
        ({"head": "../mine"}, 422, "is not a head name"),
        ({"head": "mine", "ood": "true"}, 422, "a head's classes have no reference statistics"),
        ({"head": "mine", "attention": "gradient"}, 422, "ask attention=rollout or last"),
        ({"head": "mine", "labels": "a,b"}, 422, "send one or the other"),
    ],
)
def test_what_a_head_cannot_be_asked_with_is_refused(
    server: Server, expected: tuple[list[bytes], torch.Tensor, TaughtHead], params: dict[str, str], status: int,
    message: str,
) -> None:  # fmt: skip
    pngs, _, _ = expected
    r = httpx.post(server.url + "/predict", params=params, files={"file": ("a.png", pngs[0])}, timeout=30)
    assert r.status_code == status and message in r.json()["detail"], r.text


def test_a_heads_rollout_map_is_the_models(
    server: Server, expected: tuple[list[bytes], torch.Tensor, TaughtHead]
) -> None:
    pngs, _, _ = expected
    files = {"file": ("a.png", pngs[0], "image/png")}
    headed = httpx.post(
        server.url + "/predict", params={"head": "mine", "attention": "rollout"}, files=files, timeout=30
    )
    plain = httpx.post(server.url + "/predict", params={"attention": "rollout"}, files=files, timeout=30)
    assert headed.status_code == 200 and plain.status_code == 200, (headed.text, plain.text)
    torch.testing.assert_close(
        torch.tensor(headed.json()["results"][0]["attention"]["map"]),
        torch.tensor(plain.json()["results"][0]["attention"]["map"]),
    )


def test_a_head_taught_over_rest_answers_at_once_over_every_protocol_and_front_end_until_deleted(
    server: Server, expected: tuple[list[bytes], torch.Tensor, TaughtHead], folder: Path
) -> None:
    pngs, _, _ = expected
    files = [
        (name, (f"{name}{i}.png", encode(image), "image/png"))
        for name, label in TAUGHT.items()
        for i, image in enumerate(shapes(label, 5, 100))
    ]
    r = httpx.post(server.url + "/v1/models/shapes/heads/fresh", files=files, timeout=60)
    assert r.status_code == 201, r.text
    assert r.json()["examples"] == dict.fromkeys(TAUGHT, 5) and r.json()["model"]["name"] == "shapes"
    head = load(head_path(folder / "shapes.safetensors", "fresh"))
    # each request on a connection of its own: with two serving processes, both answer for the new head
    for _ in range(4):
        r = httpx.post(server.url + "/predict", params={"head": "fresh", "embedding": "true"},
                       files=[("files", (f"{i}.png", png)) for i, png in enumerate(pngs)], timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        got = torch.tensor([result["probabilities"] for result in r.json()["results"]])
        embeddings = torch.tensor([result["embedding"] for result in r.json()["results"]])
        torch.testing.assert_close(got, head.probabilities(embeddings), atol=EXACT, rtol=0)
        assert [res["top_k"][0]["label"] for res in r.json()["results"]] == [c for c in TAUGHT for _ in range(2)]
    grpc = triton_grpc.InferenceServerClient(server.grpc_target)
    try:
        tensor = triton_grpc.InferInput("image", [len(pngs)], "BYTES")
        tensor.set_data_from_numpy(np.array(pngs, dtype=np.object_))
        answered = grpc.infer("shapes", [tensor], parameters={"head": "fresh"})
        assert answered.as_numpy("probabilities").shape == (len(pngs), len(TAUGHT))
        assert httpx.delete(server.url + "/v1/models/shapes/heads/fresh", timeout=30).status_code == 204
        with pytest.raises(InferenceServerException, match="has no head named 'fresh'"):
            grpc.infer("shapes", [tensor], parameters={"head": "fresh"})
    finally:
        grpc.close()
    for _ in range(4):
        r = httpx.post(
            server.url + "/predict", params={"head": "fresh"}, files={"file": ("a.png", pngs[0])}, timeout=30
        )
        assert r.status_code == 404 and "has no head named 'fresh'; its heads: mine" in r.json()["detail"], r.text
    assert not head_path(folder / "shapes.safetensors", "fresh").exists()
