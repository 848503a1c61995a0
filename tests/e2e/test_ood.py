"""Out-of-distribution scores over every protocol, against real servers: reference statistics added by
`python -m model.reference`, then `/predict?ood=true`, V2's `ood` parameter and `ood_score` output through
tritonclient over HTTP and gRPC, with one process and with front-end processes; a model without statistics
answers each protocol's client error. The same servers watch drift and shadow `vit-shapes` with `plain`."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from PIL import Image
from tritonclient.utils import InferenceServerException

from app.settings import BUNDLED_WEIGHTS
from harness.images import encode
from harness.preloaded import run_command
from harness.server import Server
from model.checkpoint import load_checkpoint, save_checkpoint
from model.shapes import make_sample
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
SHAPES = [encode(make_sample(20261121, i).image) for i in range(4)]  # held out: in distribution
NOISE = [
    encode(Image.fromarray(np.random.default_rng(i).integers(0, 256, (64, 64, 3), dtype=np.uint8))) for i in range(4)
]


@pytest.fixture(scope="module")
def referenced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model with reference statistics from 300 shapes, added by the command users run (in place of
    the 5,000 it ships with), scored as it ships: 1 - the top probability (it was trained with outlier exposure)."""
    out = tmp_path_factory.mktemp("ood") / "vit-shapes.safetensors"
    cmd = [sys.executable, "-m", "model.reference", str(BUNDLED_WEIGHTS), "--shapes", "300", "--output", str(out)]
    cmd += ["--score", "max_softmax"]
    r = run_command(cmd, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "300 procedural shapes: 10 of 10 classes seen" in r.stdout
    assert load_checkpoint(out).version == load_checkpoint(BUNDLED_WEIGHTS).version  # the model's version kept
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model as a checkpoint written before reference statistics existed: without them."""
    ckpt = load_checkpoint(BUNDLED_WEIGHTS)
    out = tmp_path_factory.mktemp("plain") / "plain.safetensors"
    save_checkpoint(out, ckpt.model, ckpt.classes, ckpt.preprocessing, ckpt.training)
    return out


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "front-ends"])
def server(request: pytest.FixtureRequest, serve: ServerFactory, referenced: Path, plain: Path) -> Server:
    models = f"vit-shapes={referenced},plain={plain}"
    return serve(
        referenced,
        VIT_MODELS=models,
        VIT_WORKERS=request.param,
        VIT_OOD_THRESHOLD="vit-shapes=0.5",
        VIT_SHADOW="vit-shapes:plain",  # the same weights: they must agree entirely
        VIT_DRIFT_WINDOW="50",
    )


def predict(server: Server, files: list[bytes], **params: str) -> httpx.Response:
    upload = [("files", (f"{i}.png", f, "image/png")) for i, f in enumerate(files)]
    return httpx.post(f"{server.url}/predict", files=upload, params={"ood": "true", **params}, timeout=60)


def test_predict_scores_noise_far_above_shapes_and_flags_it(server: Server) -> None:
    r = predict(server, SHAPES + NOISE)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    scores = [x["ood_score"] for x in results]
    assert max(scores[:4]) < min(scores[4:]), scores  # shapes 0.08 to 0.09, noise 0.29 to 0.84
    assert [x["ood"] for x in results] == [s > 0.5 for s in scores]  # VIT_OOD_THRESHOLD for this model
    assert not any(x["ood"] for x in results[:4]) and sum(x["ood"] for x in results[4:]) >= 2
    plain = httpx.post(f"{server.url}/predict", files=[("file", ("s.png", SHAPES[0], "image/png"))], timeout=60)
    assert "ood_score" not in plain.json()["results"][0] and "embedding" not in plain.json()["results"][0]
    both = predict(server, SHAPES[:1], embedding="true").json()["results"][0]
    assert both["ood_score"] == pytest.approx(scores[0], rel=1e-5) and len(both["embedding"]) == 128
    info = httpx.get(f"{server.url}/v1/models", timeout=10).json()["models"]
    assert [m["reference"] for m in info] == [True, False]
    assert [m["ood_method"] for m in info] == ["max_softmax", None]
    p99 = info[0]["ood_p99"]  # the bundled statistics keep it; a model without statistics has none
    assert info[1]["ood_p99"] is None and max(scores[:4]) < p99 < max(scores[4:])


def test_tritonclient_http_and_grpc_give_the_same_scores(server: Server) -> None:
    expected = [x["ood_score"] for x in predict(server, SHAPES + NOISE).json()["results"]]
    files = np.array(SHAPES + NOISE, dtype=np.object_)
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    tensor = triton_http.InferInput("image", [len(files)], "BYTES")
    tensor.set_data_from_numpy(files)
    outputs = [triton_http.InferRequestedOutput("probabilities"), triton_http.InferRequestedOutput("ood_score")]
    result = http.infer("vit-shapes", [tensor], outputs=outputs, parameters={"ood": True})
    np.testing.assert_allclose(result.as_numpy("ood_score"), expected, rtol=1e-5)
    meta = http.get_model_metadata("vit-shapes")
    assert {"name": "ood_score", "datatype": "FP32", "shape": [-1]} in meta["outputs"]
    assert "ood_score" not in [o["name"] for o in http.get_model_metadata("plain")["outputs"]]
    grpc = triton_grpc.InferenceServerClient(server.grpc_target)
    tensor_g = triton_grpc.InferInput("image", [len(files)], "BYTES")
    tensor_g.set_data_from_numpy(files)
    result_g = grpc.infer("vit-shapes", [tensor_g], parameters={"ood": True})
    np.testing.assert_allclose(result_g.as_numpy("ood_score"), expected, rtol=1e-5)
    asked_by_name = grpc.infer("vit-shapes", [tensor_g], outputs=[triton_grpc.InferRequestedOutput("ood_score")])
    np.testing.assert_allclose(asked_by_name.as_numpy("ood_score"), expected, rtol=1e-5)  # named alone: computed


def test_a_model_without_reference_statistics_is_a_client_error_that_says_how_to_add_them(server: Server) -> None:
    r = predict(server, SHAPES[:1], model="plain")
    assert r.status_code == 422 and "python -m model.reference" in r.json()["detail"]  # as any invalid option
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    tensor = triton_http.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array(SHAPES[:1], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="no reference statistics") as e:
        http.infer("plain", [tensor], parameters={"ood": True})
    assert e.value.status() == "400"
    grpc = triton_grpc.InferenceServerClient(server.grpc_target)
    tensor_g = triton_grpc.InferInput("image", [1], "BYTES")
    tensor_g.set_data_from_numpy(np.array(SHAPES[:1], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="no reference statistics") as e:
        grpc.infer("plain", [tensor_g], parameters={"ood": True})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert predict(server, SHAPES[:1]).status_code == 200  # and the service serves on


def test_drift_gauges_and_the_shadow_report_reach_every_front_end(server: Server) -> None:
    for _ in range(3):
        assert predict(server, SHAPES + NOISE).status_code == 200
    for _ in range(200):  # shadow work runs after the answers
        report = httpx.get(f"{server.url}/v1/models/vit-shapes/shadow", timeout=10).json()
        if report["compared"] + report["shed"] >= 24:
            break
        time.sleep(0.05)
    assert report["challenger"] == "plain" and report["compared"] + report["shed"] >= 24 and report["compared"] > 0
    assert report["top1_agreement"] == 1.0 and report["mean_tv_distance"] == pytest.approx(0.0, abs=1e-6)
    assert httpx.get(f"{server.url}/v1/models/plain/shadow", timeout=10).status_code == 404
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    embedding = re.search(r'vit_drift_score\{kind="embedding",model="vit-shapes"\} (\S+)', metrics)
    assert embedding is not None and float(embedding.group(1)) > 0
    assert 'vit_drift_score{kind="prediction",model="plain"}' not in metrics  # no reference statistics: no gauges
