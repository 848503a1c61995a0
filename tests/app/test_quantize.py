"""python -m app.quantize: a static int8 graph calibrated on images, stored beside its checkpoint, served for
that checkpoint only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from app.core.backends.onnx_runtime import OnnxExportError, int8_graph_path
from app.core.backends.predictor import Predictor
from app.core.images.prepare import Preprocessor
from app.quantize import main
from app.settings import BUNDLED_WEIGHTS
from harness.images import encode
from model.checkpoint import load_checkpoint
from model.evaluate import DEFAULT_SHAPES_EVAL_SEED
from model.shapes import make_sample
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.clients import ClientFactory

pytestmark = pytest.mark.slow  # calibrates and quantizes graphs

# Static int8 against float32, on the bundled model and held-out images: activations are quantized to
# ranges fixed by the calibration. (A random-weight model is no test of it: its features barely depend on
# the input, and a fixed int8 range rounds that dependence away.)
STATIC_MIN_AGREEMENT = 0.97  # top-1 agreement with float32
STATIC_MIN_COSINE = 0.99  # mean cosine similarity of the logits
STATIC_PROBABILITY_TOLERANCE = 0.05


@pytest.fixture
def calibration(tmp_path: Path) -> Path:
    folder = tmp_path / "calibration" / "nested"
    folder.mkdir(parents=True)
    for i in range(24):
        (folder / f"{i}.png").write_bytes(encode(make_sample(11, i).image.convert("RGB")))
    (folder / "notes.txt").write_text("not an image: not taken")
    return folder.parent


@pytest.fixture
def quantized(tmp_path: Path, calibration: Path) -> Path:
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny.safetensors")
    assert main([str(checkpoint), "--calibration", str(calibration), "--images", "16", "--batch-size", "4"]) == 0
    assert int8_graph_path(checkpoint) == tmp_path / "tiny.int8.onnx" and (tmp_path / "tiny.int8.onnx").is_file()
    return checkpoint


@pytest.fixture(scope="module")
def bundled_quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the bundled checkpoint with its static int8 graph, calibrated on 64 images of its training set."""
    checkpoint = tmp_path_factory.mktemp("bundled") / "vit-shapes.safetensors"
    shutil.copy(BUNDLED_WEIGHTS, checkpoint)
    assert main([str(checkpoint), "--calibration", "shapes", "--images", "64"]) == 0
    return checkpoint


def test_the_stored_graph_is_served_and_agrees_with_float32(bundled_quantized: Path) -> None:
    static = Predictor(load_checkpoint(bundled_quantized), torch.device("cpu"), "onnxruntime-int8")
    assert (static.quantization, static.precision) == ("static", "int8")
    fp32 = Predictor(load_checkpoint(bundled_quantized), torch.device("cpu"), "onnxruntime")
    preprocess = Preprocessor(load_checkpoint(bundled_quantized).preprocessing)
    x = torch.stack([preprocess(make_sample(DEFAULT_SHAPES_EVAL_SEED, i).image) for i in range(128)])
    got, want = static.forward_plain(x)[0], fp32.forward_plain(x)[0]
    assert (got.argmax(1) == want.argmax(1)).float().mean() >= STATIC_MIN_AGREEMENT
    assert torch.nn.functional.cosine_similarity(got, want).mean() >= STATIC_MIN_COSINE


def test_a_graph_made_for_another_checkpoint_is_refused(quantized: Path, tmp_path: Path) -> None:
    other = write_tiny_checkpoint(tmp_path / "other" / "tiny.safetensors", seed=1)
    shutil.copy(int8_graph_path(quantized), int8_graph_path(other))
    with pytest.raises(
        OnnxExportError, match="was made for another checkpoint .* make it again with python -m app.quantize"
    ):
        Predictor(load_checkpoint(other), torch.device("cpu"), "onnxruntime-int8")
    assert (
        Predictor(load_checkpoint(other), torch.device("cpu"), "onnxruntime").quantization is None
    )  # float32 ignores it


async def test_served_through_predict_and_v2(bundled_quantized: Path, make_client: ClientFactory) -> None:
    files = [("files", (f"{i}.png", encode(make_sample(5, i).image), "image/png")) for i in range(3)]
    answers = {}
    for backend in ("onnxruntime-int8", "onnxruntime"):
        async with make_client(weights=bundled_quantized, backend=backend) as client:
            info = (await client.get("/v1/model")).json()
            meta = (await client.get("/v2/models/vit-shapes")).json()
            r = await client.post("/predict", files=files)
            assert r.status_code == 200, r.text
            answers[backend] = [res["probabilities"] for res in r.json()["results"]]
            if backend == "onnxruntime-int8":
                assert (info["precision"], info["quantization"]) == ("int8", "static")
                assert meta["parameters"] == {
                    "content_hash": info["content_hash"],
                    "backend": backend,
                    "precision": "int8",
                    "quantization": "static",
                }
            else:
                assert info["quantization"] is None and "quantization" not in meta["parameters"]
    got, want = torch.tensor(answers["onnxruntime-int8"]), torch.tensor(answers["onnxruntime"])
    assert (got - want).abs().max() < STATIC_PROBABILITY_TOLERANCE


def test_bad_arguments(tmp_path: Path, calibration: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny.safetensors")
    with pytest.raises(SystemExit) as exit_:
        main([str(checkpoint), "--calibration", str(tmp_path / "missing")])
    assert exit_.value.code == 2 and "not a folder (or 'shapes')" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no image files"):
        main([str(checkpoint), "--calibration", str(empty)])
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "nope.safetensors"), "--calibration", str(calibration)])
    assert exit_.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([str(checkpoint), "--calibration", "shapes", "--batch-size", "0"])
    assert exit_.value.code == 2 and "argument --batch-size: must be at least 1, got 0" in capsys.readouterr().err
