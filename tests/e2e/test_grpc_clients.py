"""The Open Inference Protocol over gRPC with the real clients, tritonclient[grpc] and kserve, against a real
server process: the same images give the same answers over gRPC, V2 REST and /predict."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from app.codecs.proto.service_pb2_grpc import GRPCInferenceServiceStub
from app.core.contract.description import numeric_version
from app.settings import BUNDLED_WEIGHTS
from harness.images import encode
from harness.server import Server
from model.checkpoint import load_checkpoint
from model.shapes import SHAPE_CLASSES, make_sample
from tests.support.grpc_requests import image_request
from tests.support.kserve_client import run as kserve_session
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
MODEL = "vit-shapes"
VERSION = numeric_version(load_checkpoint(BUNDLED_WEIGHTS).content_hash)
PNGS = [encode(make_sample(20261123, i).image) for i in range(4)]


@pytest.fixture(scope="module")
def server(serve: ServerFactory) -> Server:
    return serve(BUNDLED_WEIGHTS, VIT_MAX_FILES="8", VIT_MAX_QUEUE="64")


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(server.grpc_target)
    yield c
    c.close()


def images(*files: bytes) -> triton.InferInput:
    tensor = triton.InferInput("image", [len(files)], "BYTES")
    tensor.set_data_from_numpy(np.array(files, dtype=np.object_))
    return tensor


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, VERSION) and not client.is_model_ready("nope")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "vit-serve" and {"classification", "model_repository"} <= set(meta["extensions"])
    model = client.get_model_metadata(MODEL, as_json=True)
    assert model["versions"] == [VERSION] and model["platform"] == "onnxruntime_onnx"
    assert [(t["name"], t["datatype"], t["shape"]) for t in model["inputs"]] == [
        ("image", "BYTES", ["-1", "1"]),
        ("pixels", "FP32", ["-1", "1", "64", "64"]),
    ]


def test_the_model_configuration_is_the_rest_one_and_parses_as_tritons(
    client: triton.InferenceServerClient, server: Server
) -> None:
    config = client.get_model_config(MODEL)  # tritonclient's own ModelConfigResponse: its schema parsed the bytes
    assert config.config.name == MODEL and config.config.max_batch_size == 8  # VIT_MAX_FILES
    assert [i.optional for i in config.config.input] == [False, True]  # pixels is the alternative to image
    assert "model_configuration" in client.get_server_metadata(as_json=True)["extensions"]
    rest = httpx.get(f"{server.url}/v2/models/{MODEL}/config").json()
    over_rest = json_format.ParseDict(rest, model_config_pb2.ModelConfig(), ignore_unknown_fields=False)
    assert over_rest == config.config
    assert client.get_model_config(MODEL, VERSION).config == config.config
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_config("nope")
    assert raised.value.status() == "StatusCode.NOT_FOUND"


def test_the_same_images_give_the_same_answers_on_every_protocol(
    client: triton.InferenceServerClient, server: Server
) -> None:
    result = client.infer(MODEL, [images(*PNGS)], request_id="g-1")
    over_grpc = result.as_numpy("probabilities")
    assert over_grpc.shape == (4, 10) and over_grpc.dtype == np.float32
    assert result.get_response().model_version == VERSION and result.get_response().id == "g-1"
    rest = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    tensor = triton_http.InferInput("image", [len(PNGS)], "BYTES")
    tensor.set_data_from_numpy(np.array(PNGS, dtype=np.object_), binary_data=True)
    over_rest = rest.infer(MODEL, [tensor]).as_numpy("probabilities")
    files = [("files", (f"{i}.png", png, "image/png")) for i, png in enumerate(PNGS)]
    r = httpx.post(f"{server.url}/predict", files=files, params={"top_k": 1}, timeout=30)
    assert r.status_code == 200, r.text
    over_predict = np.array([res["probabilities"] for res in r.json()["results"]], dtype=np.float32)
    np.testing.assert_allclose(over_grpc, over_rest, atol=1e-6)
    np.testing.assert_allclose(over_grpc, over_predict, atol=1e-6)
    assert [SHAPE_CLASSES[i] for i in over_grpc.argmax(1)] == [
        SHAPE_CLASSES[make_sample(20261123, i).label] for i in range(4)
    ]


def test_pixels_outputs_classification_and_parameters(client: triton.InferenceServerClient) -> None:
    pixels = triton.InferInput("pixels", [2, 1, 64, 64], "FP32")
    pixels.set_data_from_numpy(np.zeros((2, 1, 64, 64), np.float32))
    assert client.infer(MODEL, [pixels]).as_numpy("probabilities").shape == (2, 10)
    outputs = [
        triton.InferRequestedOutput("probabilities", class_count=3),
        triton.InferRequestedOutput("attention"),
        triton.InferRequestedOutput("embedding"),
    ]
    result = client.infer(
        MODEL,
        [images(*PNGS[:2])],
        outputs=outputs,
        parameters={"attention": "gradient", "target": "star", "normalize": True, "embedding": True},
    )
    top = result.as_numpy("probabilities")
    assert top.shape == (2, 3) and all(len(x.decode().split(":")) == 3 for x in top.flatten())
    assert result.as_numpy("attention").shape == (2, 8, 8)
    np.testing.assert_allclose(np.linalg.norm(result.as_numpy("embedding"), axis=1), 1, atol=1e-5)


def test_errors_have_their_status_codes(client: triton.InferenceServerClient) -> None:
    def code(call: object) -> str:
        with pytest.raises(InferenceServerException) as caught:
            call()  # type: ignore[operator]
        return f"{caught.value.status()} {caught.value.message()}"

    wrong = triton.InferInput("pixels", [1, 3, 64, 64], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 3, 64, 64), np.float32))
    assert code(lambda: client.infer(MODEL, [wrong])).startswith(
        "StatusCode.INVALID_ARGUMENT input 'pixels' must have shape"
    )
    assert code(lambda: client.infer(MODEL, [images(b"not an image")])).startswith(
        "StatusCode.INVALID_ARGUMENT image[0]: not a recognised image"
    )
    assert code(lambda: client.infer("nope", [images(PNGS[0])])).startswith(
        "StatusCode.NOT_FOUND no model named 'nope'"
    )
    assert code(lambda: client.infer(MODEL, [images(*[PNGS[0]] * 9)])).endswith("at most 8 are accepted")
    big = triton.InferInput("image", [1], "BYTES")
    big.set_data_from_numpy(np.array([b"x" * (11 * 1024 * 1024)], dtype=np.object_))
    assert code(lambda: client.infer(MODEL, [big])).startswith("StatusCode.RESOURCE_EXHAUSTED")
    assert code(lambda: client.load_model(MODEL)).startswith("StatusCode.FAILED_PRECONDITION")
    assert client.is_server_ready()


def test_kserve_grpc_client(server: Server, tmp_path: Path) -> None:
    paths = []
    for i, png in enumerate(PNGS[:2]):
        paths.append(tmp_path / f"{i}.png")
        paths[-1].write_bytes(png)
    seen = kserve_session("grpc", server.grpc_target, MODEL, [1, 1, 64, 64], paths)
    assert seen["live"] and seen["ready"] and seen["model_ready"]
    assert seen["id"] == "k-1" and seen["model_version"] == VERSION and seen["attention_shape"] == [2, 8, 8]
    expected = httpx.post(
        f"{server.url}/predict", files=[("files", (p.name, p.read_bytes(), "image/png")) for p in paths]
    )
    np.testing.assert_allclose(
        seen["probabilities"], [res["probabilities"] for res in expected.json()["results"]], atol=1e-6
    )
    assert seen["pixels_probabilities_shape"] == [1, 10]
    assert seen["unknown_model"][0] == "NOT_FOUND" and "no model named 'nope'" in seen["unknown_model"][1]


def test_grpc_requests_are_in_the_metrics(client: triton.InferenceServerClient, server: Server) -> None:
    client.infer(MODEL, [images(PNGS[0])])
    text = httpx.get(f"{server.url}/metrics").text
    assert 'vit_requests_total{protocol="grpc",route="ModelInfer",status="OK"}' in text
    assert 'vit_requests_total{protocol="grpc",route="ModelInfer",status="NOT_FOUND"}' in text


def test_sigterm_answers_the_calls_under_way() -> None:
    """gRPC calls in flight when SIGTERM arrives are all answered; then the process exits cleanly."""
    with Server(BUNDLED_WEIGHTS, VIT_MAX_BATCH_SIZE="4", VIT_MAX_FILES="8", VIT_WARMUP="false") as s:
        request = image_request(*PNGS, *PNGS, model=MODEL)

        async def in_flight() -> list[int]:
            async with grpc.aio.insecure_channel(s.grpc_target) as channel:
                stub = GRPCInferenceServiceStub(channel)
                calls = [asyncio.ensure_future(stub.ModelInfer(request, timeout=60)) for _ in range(32)]
                await s.until_accepted("grpc", "ModelInfer", 32)  # every call taken (in flight or answered)
                s.proc.send_signal(signal.SIGTERM)
                return [len(r.outputs) for r in await asyncio.gather(*calls)]

        assert asyncio.run(in_flight()) == [1] * 32
        assert s.proc.wait(timeout=30) == 0
    out = s.stop()  # everything it wrote
    assert "stopped" in out


def test_statistics_over_grpc_are_those_over_http(client: triton.InferenceServerClient, server: Server) -> None:
    earlier = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]["inference_stats"]
    failed = int(earlier.get("fail", {}).get("count", 0))  # protobuf's JSON leaves zeros out
    client.infer(MODEL, [images(*PNGS[:2])])
    with pytest.raises(InferenceServerException, match="not a recognised image"):
        client.infer(MODEL, [images(PNGS[0], b"not an image")])
    over_grpc = client.get_inference_statistics(MODEL, as_json=True)
    over_http = httpx.get(f"{server.url}/v2/models/{MODEL}/stats").json()
    [g], [h] = over_grpc["model_stats"], over_http["model_stats"]
    assert (g["name"], g["version"]) == (h["name"], h["version"]) == (MODEL, VERSION)
    assert int(g["inference_count"]) == h["inference_count"] >= 2  # protobuf's JSON writes uint64 as strings
    assert int(g["inference_stats"]["success"]["count"]) == h["inference_stats"]["success"]["count"]
    assert int(g["inference_stats"]["queue"]["ns"]) == h["inference_stats"]["queue"]["ns"]
    assert int(g["inference_stats"]["fail"]["count"]) == h["inference_stats"]["fail"]["count"] == failed + 1
    assert [int(b["batch_size"]) for b in g["batch_stats"]] == [b["batch_size"] for b in h["batch_stats"]]
    with pytest.raises(InferenceServerException, match="has no statistics") as raised:
        client.get_inference_statistics("nope")
    assert raised.value.status() == "StatusCode.NOT_FOUND"
