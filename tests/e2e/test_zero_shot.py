"""CLIP and SigLIP named by hub (`hf:openai/clip-vit-base-patch32`, `hf:google/siglip-base-patch16-224`, tiny
random-weight models the test lays out as the hub's cache does) served zero-shot by a real server with two
front-ends, through /predict and the real Open Inference Protocol clients over HTTP and gRPC."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from PIL import Image

from harness.images import encode
from harness.server import Server
from tests.e2e.test_hub_models import hub_env, snapshot
from tests.support.servers import ServerFactory
from tests.support.zero_shot import Repo, clip_repo, pipeline_scores, siglip_repo

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
REPOS = {"clip": ("openai/clip-vit-base-patch32", clip_repo), "siglip": ("google/siglip-base-patch16-224", siglip_repo)}

ATOL = 1e-4


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Repo]]:
    """A hub cache holding both models, each with its tokenizer and image processor files."""
    root = tmp_path_factory.mktemp("hub")
    made = {}
    for name, (hub_id, make) in REPOS.items():
        made[name] = make(tmp_path_factory.mktemp(name))
        shutil.copytree(made[name].path, snapshot(root, hub_id), dirs_exist_ok=True)
    return root, made


@pytest.fixture(scope="module")
def server(
    serve: ServerFactory, repos: tuple[Path, dict[str, Repo]], tmp_path_factory: pytest.TempPathFactory
) -> Server:
    root, _ = repos
    models = ",".join(f"{name}=hf:{hub_id}" for name, (hub_id, _) in REPOS.items())
    env = hub_env(root, tmp_path_factory.mktemp("converted"), models)
    del env["VIT_BACKEND"]  # served on the CPU's default backend, ONNX Runtime, as a user's server serves them
    return serve(Path("unused.safetensors"), VIT_WORKERS="2", **env)


@pytest.fixture(scope="module")
def image() -> tuple[bytes, Image.Image]:
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    pixels[:, :32] //= 3  # a dark half: the image is not uniform noise
    png = encode(Image.fromarray(pixels))
    return png, Image.open(io.BytesIO(png)).convert("RGB")


@pytest.mark.parametrize("model", ["clip", "siglip"])
def test_predict_answers_the_pipelines_probabilities(
    server: Server, repos: tuple[Path, dict[str, Repo]], image: tuple[bytes, Image.Image], model: str
) -> None:
    png, decoded = image
    r = httpx.post(
        server.url + "/predict",
        params={"model": model, "labels": "cat,dog", "label": ["a red car", "Hello, World!"], "top_k": 4},
        files={"file": ("x.png", png, "image/png")},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    labels = ["cat", "dog", "a red car", "Hello, World!"]
    expected = pipeline_scores(repos[1][model], decoded, labels)
    assert expected.max() - expected.min() > 0.01
    result = r.json()["results"][0]
    torch.testing.assert_close(torch.tensor(result["probabilities"]), expected, atol=ATOL, rtol=0)
    assert result["top_k"][0]["label"] == labels[int(expected.argmax())]
    info = httpx.get(server.url + "/v1/models", timeout=10).json()["models"]
    rules = {m["name"]: m["zero_shot"]["rule"] for m in info}
    assert rules == {"clip": "softmax", "siglip": "sigmoid"}


@pytest.fixture(scope="module")
def http_client(server: Server) -> Iterator[triton_http.InferenceServerClient]:
    c = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


def test_v2_over_http_takes_labels_and_a_template(
    http_client: triton_http.InferenceServerClient,
    repos: tuple[Path, dict[str, Repo]],
    image: tuple[bytes, Image.Image],
) -> None:
    png, decoded = image
    tensor = triton_http.InferInput("image", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([png, png], dtype=np.object_), binary_data=True)
    outputs = [triton_http.InferRequestedOutput("probabilities", binary_data=True)]
    parameters = {"labels": "cat,dog,x", "template": "a drawing of {}"}
    result = http_client.infer("siglip", [tensor], outputs=outputs, parameters=parameters)
    probs = result.as_numpy("probabilities")
    described = result.get_response()["parameters"]
    assert described == {"zero_shot_rule": "sigmoid", "zero_shot_template": "a drawing of {}"}
    assert probs.shape == (2, 3)
    expected = pipeline_scores(repos[1]["siglip"], decoded, ["cat", "dog", "x"], "a drawing of {}")
    torch.testing.assert_close(torch.tensor(probs[1]), expected, atol=ATOL, rtol=0)
    metadata = http_client.get_model_metadata("siglip")
    assert next(o for o in metadata["outputs"] if o["name"] == "probabilities")["shape"] == [-1, -1]


def test_v2_over_grpc_takes_labels_with_commas_as_a_json_array(
    server: Server, repos: tuple[Path, dict[str, Repo]], image: tuple[bytes, Image.Image]
) -> None:
    png, decoded = image
    client = triton_grpc.InferenceServerClient(server.grpc_target)
    try:
        tensor = triton_grpc.InferInput("image", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([png], dtype=np.object_))
        labels = ["Hello, World!", "café au lait", "cat"]
        outputs = [triton_grpc.InferRequestedOutput("probabilities", class_count=3)]
        ranked = client.infer("clip", [tensor], outputs=outputs, parameters={"labels": json.dumps(labels)})
        plain = client.infer("clip", [tensor], parameters={"labels": json.dumps(labels)})
        rule = plain.get_response().parameters["zero_shot_rule"].string_param
    finally:
        client.close()
    expected = pipeline_scores(repos[1]["clip"], decoded, labels)
    torch.testing.assert_close(torch.tensor(plain.as_numpy("probabilities")[0]), expected, atol=ATOL, rtol=0)
    assert rule == "softmax"
    names = [entry.decode().split(":", 2)[2] for entry in ranked.as_numpy("probabilities")[0]]
    assert names == [labels[i] for i in expected.argsort(descending=True).tolist()]


def test_a_request_without_labels_is_refused_by_every_protocol(
    server: Server, http_client: triton_http.InferenceServerClient, image: tuple[bytes, Image.Image]
) -> None:
    png, _ = image
    r = httpx.post(server.url + "/predict?model=clip", files={"file": ("x.png", png, "image/png")}, timeout=60)
    assert r.status_code == 422 and "no default labels" in r.json()["detail"], r.text
    tensor = triton_http.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([png], dtype=np.object_), binary_data=True)
    with pytest.raises(Exception, match="no default labels"):
        http_client.infer("clip", [tensor])


def library_text_embeddings(repo: Repo, texts: list[str], siglip: bool) -> torch.Tensor:
    """transformers' own text features, unit length: CLIP pads to the longest text, SigLIP to 64 as its pipeline does."""
    padding: str | bool = "max_length" if siglip else True
    tokens = repo.tokenizer(texts, padding=padding, return_tensors="pt")
    with torch.inference_mode():
        features = repo.model.get_text_features(**tokens)
    features = features if isinstance(features, torch.Tensor) else features.pooler_output
    return torch.nn.functional.normalize(features, dim=-1)


@pytest.mark.parametrize("model", ["clip", "siglip"])
def test_texts_and_images_embed_into_one_space_for_retrieval(
    server: Server, repos: tuple[Path, dict[str, Repo]], image: tuple[bytes, Image.Image], model: str
) -> None:
    """The input `text` answers `text_embedding` (over gRPC here, HTTP below), the transformers model's text
    features; an image's unit embedding, asked for alone, needs no labels; their products rank the texts as the
    library's own embeddings do."""
    png, decoded = image
    texts = ["a cat", "Hello, World!", "café au lait", "a red car"]
    client = triton_grpc.InferenceServerClient(server.grpc_target)
    try:
        text = triton_grpc.InferInput("text", [len(texts)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
        embedded = client.infer(model, [text]).as_numpy("text_embedding")
        picture = triton_grpc.InferInput("image", [1], "BYTES")
        picture.set_data_from_numpy(np.array([png], dtype=np.object_))
        asked = [triton_grpc.InferRequestedOutput("embedding")]
        image_embedding = client.infer(model, [picture], outputs=asked, parameters={"normalize": True})
    finally:
        client.close()
    repo = repos[1][model]
    expected = library_text_embeddings(repo, texts, model == "siglip")
    torch.testing.assert_close(torch.tensor(embedded), expected, atol=ATOL, rtol=0)
    pixels = repo.processor(decoded, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        features = repo.model.get_image_features(pixel_values=pixels)
    features = features if isinstance(features, torch.Tensor) else features.pooler_output
    theirs = torch.nn.functional.normalize(features, dim=-1)
    ours = torch.tensor(image_embedding.as_numpy("embedding"))
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    assert (ours @ torch.tensor(embedded).T).argsort(descending=True).tolist() == (
        (theirs @ expected.T).argsort(descending=True).tolist()
    )


def test_texts_over_http_and_what_a_text_request_cannot_ask(
    http_client: triton_http.InferenceServerClient, server: Server, repos: tuple[Path, dict[str, Repo]]
) -> None:
    text = triton_http.InferInput("text", [2, 1], "BYTES")
    text.set_data_from_numpy(np.array([["a dog"], ["x"]], dtype=np.object_), binary_data=False)
    embedded = http_client.infer("clip", [text]).as_numpy("text_embedding")
    expected = library_text_embeddings(repos[1]["clip"], ["a dog", "x"], siglip=False)
    torch.testing.assert_close(torch.tensor(embedded), expected, atol=ATOL, rtol=0)
    with pytest.raises(Exception, match="answers 'text_embedding' alone"):
        http_client.infer("clip", [text], outputs=[triton_http.InferRequestedOutput("probabilities")])
    r = httpx.post(
        f"{server.url}/v2/models/clip/infer",
        json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [" "]}]},
        timeout=30,
    )
    assert r.status_code == 400 and "an empty text" in r.json()["error"], r.text
