"""VIT_BACKEND=onnxruntime: probabilities from the graph exported at startup equal torch's; maps come from torch."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from app.core.backends import onnx_runtime as onnx_backend
from app.core.backends.onnx_attention import fuse_attention
from app.core.backends.onnx_runtime import (
    GraphCache,
    LogitsAndEmbedding,
    OnnxExportError,
    OnnxForward,
    export,
    quantize_int8,
    session,
)
from app.settings import Settings
from harness.images import encode
from model.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from model.shapes import SHAPE_CLASSES, make_sample
from model.vit import ViT
from tests.support.checkpoints import TINY, TINY_PREPROCESSING, tiny_model
from tests.support.clients import ClientFactory

pytestmark = pytest.mark.slow  # each test exports a graph to ONNX

TOLERANCE = 1e-5  # largest difference allowed between ONNX Runtime's and torch's probabilities
EMBEDDING_TOLERANCE = 1e-4  # absolute, per component of an embedding (values of order 1)

VARIANTS = {
    "standard": TINY,
    "post-norm, MLP head": replace(TINY, norm="post", head="mlp"),
    "axial attention": replace(TINY, attention_pattern="axial"),
    "registers, average pool, fc_norm, layer scale": replace(
        TINY, reg_tokens=2, class_token=False, pool="avg", fc_norm=True, layer_scale=True
    ),
    "grayscale, sincos positions": replace(TINY, in_channels=1, pos_embed="sincos2d"),
}


@pytest.fixture(scope="module")
def float_graph(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`float_graph(variant)`: the float32 graph of `tiny_model(VARIANTS[variant], seed=1)`, exported once for
    the float32 and the int8 tests of that variant (as `exported` does: `export`, then `quantize_int8`)."""
    graphs: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in graphs:
            config = VARIANTS[variant]
            path = tmp_path_factory.mktemp("graph") / "model.onnx"
            shape = (config.in_channels, config.image_size, config.image_size)
            export(LogitsAndEmbedding(tiny_model(config, seed=1)), shape, path)
            graphs[variant] = path
        return graphs[variant]

    return get


@pytest.mark.parametrize("fuse", [False, True], ids=["as exported", "attention fused"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_exported_graph_gives_torchs_probabilities_and_embeddings(
    variant: str, fuse: bool, float_graph: Callable[[str], Path]
) -> None:
    config = VARIANTS[variant]
    model = tiny_model(config, seed=1)
    graph = OnnxForward(session(float_graph(variant), threads=1, fuse=fuse), quantization=None)
    torch.manual_seed(2)
    for batch in (1, 3, 8):  # the batch dimension is dynamic
        x = torch.randn(batch, config.in_channels, config.image_size, config.image_size)
        with torch.inference_mode():
            logits, embedding, _ = model.forward_with_embedding(x)
        got_logits, got_embedding = graph(x)
        assert got_logits.shape == logits.shape and got_embedding.shape == (batch, config.dim)
        assert (got_logits.softmax(-1) - logits.softmax(-1)).abs().max() < TOLERANCE
        assert (got_embedding - embedding).abs().max() < EMBEDDING_TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
def test_plain_attention_blocks_are_fused_and_other_forms_left_as_exported(
    variant: str, float_graph: Callable[[str], Path]
) -> None:
    """Each block of the plain form becomes one Attention node (the test above runs those graphs against torch);
    axial attention, along rows and then columns, is another form and stays as exported."""
    graph = onnx.load(str(float_graph(variant)))
    exported = graph.SerializeToString()
    fused = fuse_attention(graph)
    kinds = Counter(n.op_type for n in graph.graph.node)
    depth = VARIANTS[variant].depth
    if VARIANTS[variant].attention_pattern == "axial":
        assert fused == 0 and kinds["Attention"] == 0 and graph.SerializeToString() == exported
    else:
        assert fused == depth and kinds["Attention"] == depth and kinds["Softmax"] == 0


def test_a_block_with_anything_on_its_scores_is_left_as_exported(float_graph: Callable[[str], Path]) -> None:
    """A bias added to one block's scores (a mask, a relative position bias) is not the plain form: that block
    stays as exported, and the graph still computes what it did."""
    path = float_graph("standard")
    graph = onnx.load(str(path))
    softmax = next(n for n in graph.graph.node if n.op_type == "Softmax")
    graph.graph.initializer.append(onnx.numpy_helper.from_array(np.full((1,), -0.5, np.float32), "score_bias"))
    biased = onnx.helper.make_node("Add", [softmax.input[0], "score_bias"], ["biased_scores"], name="score_bias_add")
    graph.graph.node.insert(list(graph.graph.node).index(softmax), biased)
    softmax.input[0] = "biased_scores"
    as_exported = graph.SerializeToString()
    assert fuse_attention(graph) == TINY.depth - 1
    kinds = Counter(n.op_type for n in graph.graph.node)
    assert kinds["Attention"] == TINY.depth - 1 and kinds["Softmax"] == 1
    x = np.random.default_rng(0).standard_normal((3, 3, TINY.image_size, TINY.image_size)).astype(np.float32)
    before = ort.InferenceSession(as_exported, providers=["CPUExecutionProvider"]).run(None, {"pixels": x})
    after = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"pixels": x})
    for a, b in zip(before, after, strict=True):
        assert np.abs(a - b).max() < 1e-5


def test_a_graph_the_fusion_fails_on_runs_as_exported(
    float_graph: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unforeseen(model: onnx.ModelProto) -> int:
        raise ValueError("a form the matcher did not foresee")

    monkeypatch.setattr(onnx_backend, "fuse_attention", unforeseen)
    with caplog.at_level(logging.WARNING, logger="app.inference"):
        graph = OnnxForward(session(float_graph("standard"), threads=1, fuse=True), quantization=None)
    assert "running it as exported" in caplog.text
    model = tiny_model(TINY, seed=1)
    x = torch.randn(2, TINY.in_channels, TINY.image_size, TINY.image_size)
    with torch.inference_mode():
        logits, _, _ = model.forward_with_embedding(x)
    assert (graph(x)[0].softmax(-1) - logits.softmax(-1)).abs().max() < TOLERANCE


async def test_served_probabilities_and_maps_equal_the_torch_backend(make_client: ClientFactory) -> None:
    images = [encode(make_sample(7, i).image) for i in range(4)]
    files = [("files", (f"{i}.png", im, "image/png")) for i, im in enumerate(images)]
    answers = {}
    for backend in ("onnxruntime", "torch"):
        async with make_client(backend=backend) as client:
            assert (await client.get("/v1/model")).json()["backend"] == backend
            plain = await client.post("/predict", files=files)
            mapped = await client.post("/predict", files=files, params={"attention": "rollout"})
            assert plain.status_code == mapped.status_code == 200, (plain.text, mapped.text)
            answers[backend] = (plain.json()["results"], mapped.json()["results"])
    (ort_plain, ort_mapped), (pt_plain, pt_mapped) = answers["onnxruntime"], answers["torch"]
    for a, b in zip(ort_plain, pt_plain, strict=True):
        assert a["probabilities"] == pytest.approx(b["probabilities"], abs=TOLERANCE)
        assert [t["index"] for t in a["top_k"]] == [t["index"] for t in b["top_k"]]
    for a, b in zip(ort_mapped, pt_mapped, strict=True):  # maps come from the torch model on both backends
        assert torch.tensor(a["attention"]["map"]).allclose(torch.tensor(b["attention"]["map"]), atol=1e-6)


async def test_v2_infer_on_onnxruntime(make_client: ClientFactory) -> None:
    pixels = torch.randn(2, 3, 32, 32)
    body = {
        "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [2, 3, 32, 32], "data": pixels.flatten().tolist()}]
    }
    async with make_client(backend="onnxruntime") as client:
        r = await client.post("/v2/models/tiny/infer", json=body)
        assert r.status_code == 200, r.text
        (out,) = r.json()["outputs"]
        model = client.app.state.data_plane.default.predictor.model  # type: ignore[attr-defined]
        with torch.inference_mode():
            expected = model(pixels).softmax(-1)
        assert out["data"] == pytest.approx(expected.flatten().tolist(), abs=TOLERANCE)


async def test_a_model_that_does_not_export_is_served_by_torch_under_auto(
    make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unsupported(*args: object, **kwargs: object) -> None:
        raise RuntimeError("aten::some_op has no ONNX translation")

    monkeypatch.setattr(torch.onnx, "export", unsupported)
    with caplog.at_level(logging.WARNING, logger="app"):
        async with make_client(backend="auto", onnx_cache=None) as client:  # no cached graph from another test
            assert (await client.get("/v1/model")).json()["backend"] == "torch"
            r = await client.post("/predict", files={"file": ("a.png", encode(make_sample(1, 1).image), "image/png")})
            assert r.status_code == 200
    assert any("could not be exported to ONNX" in m and "serving it with torch" in m for m in caplog.messages)
    with pytest.raises(OnnxExportError, match=r"model tiny: the model could not be exported.*VIT_BACKEND=torch"):
        async with make_client(backend="onnxruntime", onnx_cache=None):
            pass


async def test_unknown_backend_is_refused(make_client: ClientFactory) -> None:
    with pytest.raises(ValueError, match="backend"):
        async with make_client(backend="tensorrt"):
            pass


# int8 changes results: these bound how much, for the tiny random models of the tests.
INT8_PROBABILITY_TOLERANCE = 0.01  # absolute, per class
INT8_MIN_COSINE = 0.99  # of each image's logits, and of its embedding, with float32 torch's


@pytest.mark.parametrize("variant", VARIANTS)
def test_int8_graph_stays_close_to_float32(variant: str, float_graph: Callable[[str], Path]) -> None:
    config = VARIANTS[variant]
    model = tiny_model(config, seed=1)
    graph = OnnxForward(session(quantize_int8(float_graph(variant)), threads=1), quantization="dynamic")
    torch.manual_seed(2)
    x = torch.randn(16, config.in_channels, config.image_size, config.image_size)
    with torch.inference_mode():
        logits, embedding, _ = model.forward_with_embedding(x)
    got_logits, got_embedding = graph(x)
    assert (got_logits.softmax(-1) - logits.softmax(-1)).abs().max() < INT8_PROBABILITY_TOLERANCE
    assert torch.nn.functional.cosine_similarity(got_logits, logits).min() > INT8_MIN_COSINE
    assert torch.nn.functional.cosine_similarity(got_embedding, embedding).min() > INT8_MIN_COSINE
    assert not torch.equal(got_logits, logits)  # it really is another computation


async def test_int8_serves_predict_and_v2_and_says_so(make_client: ClientFactory) -> None:
    files = [("files", (f"{i}.png", encode(make_sample(7, i).image), "image/png")) for i in range(4)]
    answers = {}
    for backend in ("onnxruntime-int8", "torch"):
        async with make_client(backend=backend) as client:
            info = (await client.get("/v1/model")).json()
            meta = (await client.get("/v2/models/tiny")).json()
            r = await client.post("/predict", files=files, params={"embedding": True})
            assert r.status_code == 200, r.text
            answers[backend] = r.json()["results"]
            if backend == "onnxruntime-int8":
                assert info["backend"] == "onnxruntime-int8" and info["precision"] == "int8"
                assert meta["platform"] == "onnxruntime_onnx"
                assert meta["parameters"] == {
                    "content_hash": info["content_hash"],
                    "backend": "onnxruntime-int8",
                    "precision": "int8",
                    "quantization": "dynamic",
                }
                raw = b"".join(len(f[1][1]).to_bytes(4, "little") + f[1][1] for f in files)
                header = (
                    '{"inputs":[{"name":"image","datatype":"BYTES","shape":[4],'
                    f'"parameters":{{"binary_data_size":{len(raw)}}}}}]}}'
                ).encode()
                v2 = await client.post(
                    "/v2/models/tiny/infer",
                    content=header + raw,
                    headers={"Inference-Header-Content-Length": str(len(header))},
                )
                assert v2.status_code == 200, v2.text
                v2_probabilities = torch.tensor(v2.json()["outputs"][0]["data"]).view(4, 10)
            else:
                assert info["precision"] == "float32" and meta["parameters"]["precision"] == "float32"
    for i, (a, b) in enumerate(zip(answers["onnxruntime-int8"], answers["torch"], strict=True)):
        got, expected = torch.tensor(a["probabilities"]), torch.tensor(b["probabilities"])
        assert (got - expected).abs().max() < INT8_PROBABILITY_TOLERANCE
        assert (v2_probabilities[i] - expected).abs().max() < INT8_PROBABILITY_TOLERANCE
        embedding = torch.nn.functional.cosine_similarity(torch.tensor(a["embedding"]), torch.tensor(b["embedding"]), 0)
        assert embedding > INT8_MIN_COSINE


async def predict(client: httpx.AsyncClient, images: list[bytes]) -> list[list[float]]:
    files = [("files", (f"{i}.png", im, "image/png")) for i, im in enumerate(images)]
    r = await client.post("/predict", files=files)
    assert r.status_code == 200, r.text
    return [result["probabilities"] for result in r.json()["results"]]


@pytest.fixture
def app_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The app's log lines at INFO and above (its logger does not propagate once an app configured it)."""
    logger = logging.getLogger("app")
    logger.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger="app"):
        yield caplog
    logger.removeHandler(caplog.handler)


async def test_a_restart_takes_the_graph_from_the_cache_and_answers_the_same(
    make_client: ClientFactory, tmp_path: Path, app_log: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    images = [encode(make_sample(9, i).image) for i in range(3)]
    answers, steps = [], []
    for backend in ("onnxruntime", "onnxruntime", "onnxruntime-int8", "onnxruntime-int8"):
        app_log.clear()
        async with make_client(backend=backend, onnx_cache=cache) as client:
            answers.append(await predict(client, images))
        steps.append([s for s in ("exported the model", "quantized the cached", "from the cache") if s in app_log.text])
    # the float32 graph exported once; int8 quantized from it, not exported again; then each reused
    assert steps == [["exported the model"], ["from the cache"], ["quantized the cached"], ["from the cache"]]
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["float32", "int8"]
    assert answers[0] == answers[1] and answers[2] == answers[3]  # a cached graph computes what the export did
    for a, b in zip(answers[0], answers[2], strict=True):
        assert a == pytest.approx(b, abs=0.05)  # int8 stays close to float32

    fresh = tmp_path / "fresh"  # int8 first: its export keeps the float32 graph too, for a float32 start
    for backend, expected in (("onnxruntime-int8", "exported the model"), ("onnxruntime", "from the cache")):
        app_log.clear()
        async with make_client(backend=backend, onnx_cache=fresh) as client:
            assert await predict(client, images) == answers[2 if backend.endswith("int8") else 0]
        assert expected in app_log.text, app_log.text
    assert sorted(p.name.split("-")[0] for p in fresh.iterdir()) == ["float32", "int8"]


def test_the_cache_key_follows_weights_architecture_precision_and_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = (TINY.in_channels, TINY.image_size, TINY.image_size)
    eps = replace(TINY, norm_eps=TINY.norm_eps * 10)
    ckpts = {
        "seed 0": save(tmp_path / "a.safetensors", tiny_model(TINY, seed=0)),
        "seed 1": save(tmp_path / "b.safetensors", tiny_model(TINY, seed=1)),
        "LayerNorm eps": save(tmp_path / "c.safetensors", tiny_model(eps, seed=0)),  # the same tensors
    }
    assert ckpts["seed 0"].content_hash == ckpts["LayerNorm eps"].content_hash != ckpts["seed 1"].content_hash
    paths = {
        (name, int8): GraphCache(tmp_path, c.content_hash, c.config.to_dict(), shape, int8).path
        for name, c in ckpts.items()
        for int8 in (False, True)
    }
    assert len(set(paths.values())) == 6
    again = ckpts["seed 0"]  # and nothing else moves it
    assert GraphCache(tmp_path, again.content_hash, again.config.to_dict(), shape, False).path == paths["seed 0", False]
    monkeypatch.setattr(onnx_backend, "version", lambda name: "99.0" if name == "onnxruntime" else version(name))
    upgraded = GraphCache(tmp_path, again.content_hash, again.config.to_dict(), shape, False).path
    assert upgraded != paths["seed 0", False]  # another ONNX Runtime exports afresh


@pytest.mark.parametrize("backend", ["onnxruntime", "onnxruntime-int8"])
async def test_a_damaged_cached_graph_is_exported_again(
    make_client: ClientFactory, tmp_path: Path, app_log: pytest.LogCaptureFixture, backend: str
) -> None:
    """The float32 graph cut short: loaded by a float32 start, or quantized by an int8 one (its own graph gone)."""
    cache = tmp_path / "cache"
    images = [encode(make_sample(9, 0).image)]
    async with make_client(backend=backend, onnx_cache=cache) as client:
        before = await predict(client, images)
    for graph in cache.glob("int8-*"):
        graph.unlink()  # the next int8 start quantizes the float32 graph
    (float32,) = cache.iterdir()
    float32.write_bytes(float32.read_bytes()[:1000])  # cut short, as a full disk would leave it
    app_log.clear()
    async with make_client(backend=backend, onnx_cache=cache) as client:
        assert await predict(client, images) == before
    said = "could not load the graph" if backend == "onnxruntime" else "could not quantize the cached graph"
    assert said in app_log.text and "exporting again" in app_log.text
    assert float32.stat().st_size > 1000 and len(list(cache.iterdir())) == (1 if backend == "onnxruntime" else 2)


async def test_a_cache_folder_that_cannot_be_written_only_costs_the_export(
    make_client: ClientFactory, tmp_path: Path, app_log: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    async with make_client(backend="onnxruntime", onnx_cache=blocked / "cache") as client:
        assert len(await predict(client, [encode(make_sample(9, 0).image)])) == 1
    assert "could not keep the ONNX graph in the cache" in app_log.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "tiny.safetensors"]  # nothing half-written


def test_empty_turns_the_cache_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VIT_ONNX_CACHE", "")
    assert Settings().onnx_cache is None
    monkeypatch.delenv("VIT_ONNX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert Settings().onnx_cache == tmp_path / "vit-serve" / "onnx"


def save(path: Path, model: ViT) -> Checkpoint:
    save_checkpoint(path, model, list(SHAPE_CLASSES), TINY_PREPROCESSING)
    return load_checkpoint(path)
