"""The Open Inference Protocol with the real clients, tritonclient[http] and kserve (in its own process: see
tests/support/kserve_client.py), against a real uvicorn."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from google.protobuf import json_format
from PIL import Image
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from app.core.contract.description import numeric_version
from app.core.images.prepare import Preprocessor
from app.settings import BUNDLED_WEIGHTS
from harness.images import held_out
from harness.server import Server
from model.checkpoint import load_checkpoint
from model.shapes import SHAPE_CLASSES
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.kserve_client import run as kserve_session
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
MODEL = "vit-shapes"
VERSION = numeric_version(load_checkpoint(BUNDLED_WEIGHTS).content_hash)


@pytest.fixture(scope="module")
def server(serve: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tiny = write_tiny_checkpoint(tmp_path_factory.mktemp("v2") / "tiny.safetensors")
    return serve(BUNDLED_WEIGHTS, VIT_MODELS=f"{MODEL}={BUNDLED_WEIGHTS},tiny={tiny}")


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


def image_input(*files: bytes, binary: bool = True) -> triton.InferInput:
    """Raw file bytes through the binary extension, or base64 strings in the JSON."""
    tensor = triton.InferInput("image", [len(files)], "BYTES")
    elements = files if binary else tuple(base64.b64encode(f).decode() for f in files)
    tensor.set_data_from_numpy(np.array(elements, dtype=np.object_), binary_data=binary)
    return tensor


def test_tritonclient_reads_the_model_configuration(client: triton.InferenceServerClient) -> None:
    config = client.get_model_config(MODEL)
    parsed = json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=False)
    assert parsed.name == MODEL and parsed.max_batch_size == 16  # VIT_MAX_FILES' default
    assert {i.name: i.optional for i in parsed.input} == {"image": False, "pixels": True}
    assert client.get_model_config(MODEL, VERSION) == config
    assert client.get_model_config("tiny")["name"] == "tiny"
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_config("nope")
    assert raised.value.status() == "404"


def test_tritonclient_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, VERSION) and client.is_model_ready("tiny")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta["name"] == "vit-serve" and {"binary_tensor_data", "classification"} <= set(meta["extensions"])
    model = client.get_model_metadata(MODEL)
    assert model["versions"] == [VERSION]
    assert {(t["name"], t["datatype"], tuple(t["shape"])) for t in model["inputs"]} == {
        ("image", "BYTES", (-1, 1)),
        ("pixels", "FP32", (-1, 1, 64, 64)),
    }
    assert {(t["name"], t["datatype"], tuple(t["shape"])) for t in model["outputs"]} == {
        ("probabilities", "FP32", (-1, 10)),
        ("attention", "FP32", (-1, 8, 8)),
        ("embedding", "FP32", (-1, 128)),
        ("ood_score", "FP32", (-1,)),  # the bundled checkpoint has reference statistics
    }
    with pytest.raises(InferenceServerException, match="has no version 'abc'"):
        client.get_model_metadata(MODEL, "abc")


def test_tritonclient_binary_images_with_binary_and_json_outputs(client: triton.InferenceServerClient) -> None:
    outputs = [
        triton.InferRequestedOutput("probabilities", binary_data=True),
        triton.InferRequestedOutput("attention", binary_data=False),
    ]
    result = client.infer(
        MODEL, [image_input(held_out("star"), held_out("ring"))], outputs=outputs, parameters={"attention": "rollout"}
    )
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (2, 10) and probabilities.dtype == np.float32
    assert [SHAPE_CLASSES[i] for i in probabilities.argmax(1)] == ["star", "ring"]
    np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-5)
    maps = result.as_numpy("attention")
    assert maps.shape == (2, 8, 8) and maps.min() == 0.0 and maps.max() == 1.0
    assert result.get_response()["model_version"] == VERSION


def test_tritonclient_embedding_output_equals_predict(client: triton.InferenceServerClient, server: Server) -> None:
    """The `embedding` output, binary, normalised on request, equals /predict's embedding of the same files."""
    pngs = [held_out("star"), held_out("ring")]
    result = client.infer(
        MODEL,
        [image_input(*pngs)],
        outputs=[triton.InferRequestedOutput("embedding", binary_data=True)],
        parameters={"embedding": True, "normalize": True},
    )
    embedding = result.as_numpy("embedding")
    assert embedding.shape == (2, 128) and embedding.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1.0, atol=1e-5)
    files = [("files", (f"{i}.png", png, "image/png")) for i, png in enumerate(pngs)]
    r = httpx.post(f"{server.url}/predict", files=files, params={"embedding": True, "normalize": True}, timeout=30)
    assert r.status_code == 200, r.text
    expected = np.array([res["embedding"] for res in r.json()["results"]], dtype=np.float32)
    np.testing.assert_allclose(embedding, expected, atol=1e-6)


def test_tritonclient_classification_extension(client: triton.InferenceServerClient) -> None:
    result = client.infer(
        MODEL, [image_input(held_out("arrow"))], outputs=[triton.InferRequestedOutput("probabilities", class_count=3)]
    )
    top = result.as_numpy("probabilities")
    assert top.shape == (1, 3)
    score, index, label = top[0, 0].decode().split(":")
    assert label == "arrow" and SHAPE_CLASSES[int(index)] == "arrow" and 0.5 < float(score) <= 1.0


def test_tritonclient_fp32_pixels_match_the_image_path(client: triton.InferenceServerClient) -> None:
    """Preprocessed pixels sent as FP32 give the probabilities the service computes from the file."""
    png = held_out("cross")
    checkpoint = load_checkpoint(BUNDLED_WEIGHTS)
    pixels = Preprocessor(checkpoint.preprocessing)(Image.open(io.BytesIO(png)).convert("L"))[None].numpy()
    for binary in (True, False):
        tensor = triton.InferInput("pixels", list(pixels.shape), "FP32")
        tensor.set_data_from_numpy(pixels, binary_data=binary)
        from_pixels = client.infer(MODEL, [tensor]).as_numpy("probabilities")
        from_file = client.infer(MODEL, [image_input(png, binary=binary)]).as_numpy("probabilities")
        np.testing.assert_allclose(from_pixels, from_file, atol=1e-6)


def test_tritonclient_errors_are_4xx_with_what_to_fix(client: triton.InferenceServerClient) -> None:
    wrong = triton.InferInput("pixels", [1, 3, 64, 64], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 3, 64, 64), np.float32))
    with pytest.raises(InferenceServerException, match=r"\[400\].*must have shape \[-1, 1, 64, 64\]"):
        client.infer(MODEL, [wrong])
    with pytest.raises(InferenceServerException, match=r"\[400\] image\[0\]: not a recognised image"):
        client.infer(MODEL, [image_input(b"plain text, not an image")])
    with pytest.raises(InferenceServerException, match=r"\[400\].*attention must be one of"):
        client.infer(MODEL, [image_input(held_out("star"))], parameters={"attention": "gradcam"})
    with pytest.raises(InferenceServerException, match=r"\[404\] no model named 'nope'"):
        client.infer("nope", [image_input(held_out("star"))])


def test_kserve_client(server: Server, tmp_path: Path) -> None:
    paths = []
    for label in ("star", "ring"):
        paths.append(tmp_path / f"{label}.png")
        paths[-1].write_bytes(held_out(label))
    seen = kserve_session("rest", server.url, MODEL, [2, 1, 64, 64], paths)
    assert seen["live"] and seen["ready"] and seen["model_ready"]
    assert seen["id"] == "k-1" and seen["attention_shape"] == [2, 8, 8]  # (it reads no model_version from REST)
    assert [SHAPE_CLASSES[int(np.argmax(p))] for p in seen["probabilities"]] == ["star", "ring"]
    assert seen["pixels_probabilities_shape"] == [2, 10]
    assert "no model named 'nope'" in seen["unknown_model"][1]


def test_v2_and_predict_share_the_batcher_and_metrics(server: Server, client: triton.InferenceServerClient) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    png = held_out("star")
    client.infer(MODEL, [image_input(png, png)])
    httpx.post(f"{server.url}/predict", files={"file": ("s.png", png, "image/png")}, timeout=30)
    after = httpx.get(f"{server.url}/metrics").text

    def processed(text: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(f'vit_images_processed_total{{model="{MODEL}"}}'))
        return float(line.split()[-1])

    assert processed(after) - processed(before) == 3
    assert 'vit_requests_total{protocol="http",route="/v2/models/{name}/infer",status="200"}' in after


def test_tritonclient_statistics_agree_with_the_metrics(client: triton.InferenceServerClient, server: Server) -> None:
    """Triton's statistics extension as tritonclient reads it: per model version, counted as /metrics counts."""
    before = client.get_inference_statistics(MODEL)["model_stats"]
    for _ in range(3):
        client.infer(MODEL, [image_input(held_out("star"), held_out("circle"))])
    for _ in range(2):  # bad inputs: the model was found, the request failed
        with pytest.raises(InferenceServerException, match="not a recognised image"):
            client.infer(MODEL, [image_input(held_out("star"), b"not an image")])
    [stats] = client.get_inference_statistics(MODEL)["model_stats"]
    metrics = httpx.get(server.url + "/metrics").text
    [old] = before
    assert (stats["name"], stats["version"]) == (MODEL, VERSION)
    inference = stats["inference_stats"]
    assert inference["success"]["count"] - old["inference_stats"]["success"]["count"] == 3
    assert inference["fail"]["count"] - old["inference_stats"]["fail"]["count"] == 2
    assert inference["fail"]["ns"] > old["inference_stats"]["fail"]["ns"]
    assert stats["inference_count"] - old["inference_count"] == 6
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[part]["count"] == inference["success"]["count"], part
    assert inference["compute_infer"]["ns"] > 0 and inference["success"]["ns"] >= inference["compute_infer"]["ns"]
    assert stats["last_inference"] > old["last_inference"]
    # the same counts as /metrics: images computed, forward passes, and the batch sizes they had
    assert stats["inference_count"] == metric(metrics, f'vit_images_processed_total{{model="{MODEL}"}}')
    assert stats["execution_count"] == metric(metrics, f'vit_batch_size_count{{model="{MODEL}"}}')
    sizes = sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"])
    assert sizes == metric(metrics, f'vit_batch_size_sum{{model="{MODEL}"}}')
    assert sum(b["compute_infer"]["count"] for b in stats["batch_stats"]) == stats["execution_count"]
    # every model version, one model's versions, one version; unknown ones are not found
    assert {s["name"] for s in client.get_inference_statistics()["model_stats"]} == {MODEL, "tiny"}
    [one] = client.get_inference_statistics(MODEL, VERSION)["model_stats"]
    assert one["version"] == VERSION
    for name, version in (("nope", ""), (MODEL, "0")):
        with pytest.raises(InferenceServerException, match="has no statistics"):
            client.get_inference_statistics(name, version)
    assert "statistics" in client.get_server_metadata()["extensions"]


def metric(text: str, series: str) -> float:
    [value] = [line.split()[-1] for line in text.splitlines() if line.startswith(series + " ")]
    return float(value)
