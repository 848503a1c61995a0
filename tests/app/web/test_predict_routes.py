from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import threading
from pathlib import Path
from typing import Annotated, Any
from unittest.mock import MagicMock

import httpx
import pytest
import torch
from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from PIL import Image
from starlette.datastructures import QueryParams

from app.core.contract.description import numeric_version
from app.core.engine.engine import Engine
from app.settings import Settings
from app.web import uploads
from app.web.app import create_app
from app.web.dependencies import authorized_data_plane
from app.web.middleware import RequestIds
from app.web.predict_routes import PredictEndpointRoute, PredictQuery, read_query, router
from harness.images import encode
from model.checkpoint import load_checkpoint, save_checkpoint
from model.shapes import SHAPE_CLASSES, make_sample
from model.vit import ViTConfig
from tests.support.checkpoints import TINY, TINY_PREPROCESSING, tiny_model
from tests.support.clients import ClientFactory

TINY_MODEL = '{model="tiny"}'  # the tiny checkpoint's file stem names its model


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name}{labels} not in metrics"
    return float(m.group(1))


async def test_single_image_as_file(client: httpx.AsyncClient, shape_png: bytes) -> None:
    r = await client.post("/predict", files={"file": ("star.png", shape_png, "image/png")})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"]["name"] == "tiny" and body["model"]["version"].isdigit()
    (result,) = body["results"]
    assert result["filename"] == "star.png"
    assert len(result["probabilities"]) == 10
    assert sum(result["probabilities"]) == pytest.approx(1.0, abs=1e-5)
    assert len(result["top_k"]) == 5
    probs = [t["probability"] for t in result["top_k"]]
    assert probs == sorted(probs, reverse=True)
    for t in result["top_k"]:
        assert t["label"] == SHAPE_CLASSES[t["index"]]
        assert t["probability"] == pytest.approx(result["probabilities"][t["index"]])
    assert "attention" not in result and "overlay_png" not in result


async def test_served_probabilities_match_the_model(client: httpx.AsyncClient, tiny_checkpoint: Path) -> None:
    """The service's output equals the checkpoint's model run on the same preprocessing."""
    import torch

    from app.core.images.prepare import Preprocessor

    ckpt = load_checkpoint(tiny_checkpoint)
    image = make_sample(5, 3).image
    r = await client.post("/predict", files={"file": ("a.png", encode(image), "image/png")})
    assert r.status_code == 200, r.text
    with torch.inference_mode():
        expected = ckpt.model(Preprocessor(ckpt.preprocessing)(image)[None]).softmax(-1)[0]
    assert r.json()["results"][0]["probabilities"] == pytest.approx(expected.tolist(), abs=1e-5)


async def test_several_images_as_files_keep_their_order(client: httpx.AsyncClient) -> None:
    images = [make_sample(1, i).image for i in range(3)]
    files = [("files", (f"img{i}.png", encode(im), "image/png")) for i, im in enumerate(images)]
    r = await client.post("/predict", files=files, params={"top_k": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["filename"] for x in results] == ["img0.png", "img1.png", "img2.png"]
    assert all(len(x["top_k"]) == 2 for x in results)
    single = await client.post("/predict", files={"file": ("img1.png", encode(images[1]), "image/png")})
    assert single.json()["results"][0]["probabilities"] == pytest.approx(results[1]["probabilities"], abs=1e-5)


async def test_a_large_multipart_body_is_parsed_off_the_event_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed_on: list[bool] = []
    parse = uploads.read_form

    def watched(*args: Any) -> list[tuple[str, str, bytes]]:
        parsed_on.append(threading.current_thread() is threading.main_thread())
        return parse(*args)

    monkeypatch.setattr(uploads, "read_form", watched)
    small = encode(make_sample(3, 0).image)
    large = encode(Image.effect_noise((720, 720), 80).convert("RGB"))  # a PNG of noise: over 1 MiB
    assert len(small) < uploads.PARSE_ON_THE_LOOP_BYTES < len(large)
    files = [("files", ("small.png", small, "image/png")), ("files", ("large.png", large, "image/png"))]
    r = await client.post("/predict", files=files)
    assert r.status_code == 200, r.text
    assert [x["filename"] for x in r.json()["results"]] == ["small.png", "large.png"]
    r = await client.post("/predict", files={"file": ("small.png", small, "image/png")})
    assert r.status_code == 200, r.text
    assert parsed_on == [False, True]  # the large body in a worker thread, the small one on the loop


async def test_raw_body_with_image_content_type(client: httpx.AsyncClient) -> None:
    jpeg = encode(make_sample(2, 0).image, "JPEG", quality=90)
    r = await client.post("/predict", content=jpeg, headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["filename"] == "body"


@pytest.mark.parametrize("method", ["rollout", "last"])
async def test_attention_map_matches_the_grid(client: httpx.AsyncClient, shape_png: bytes, method: str) -> None:
    r = await client.post("/predict", files={"file": ("s.png", shape_png, "image/png")}, params={"attention": method})
    assert r.status_code == 200, r.text
    att = r.json()["results"][0]["attention"]
    assert att["method"] == method and att["grid"] == [4, 4]  # tiny model: 32 px / 8 px patches
    values = [v for row in att["map"] for v in row]
    assert len(att["map"]) == 4 and all(len(row) == 4 for row in att["map"])
    assert min(values) == pytest.approx(0.0, abs=1e-6) and max(values) == pytest.approx(1.0, abs=1e-6)


async def test_overlay_is_a_png_of_the_image(client: httpx.AsyncClient) -> None:
    image = Image.new("RGB", (120, 80), "white")
    r = await client.post(
        "/predict",
        files={"file": ("w.png", encode(image), "image/png")},
        params={"attention": "rollout", "overlay": "true"},
    )
    assert r.status_code == 200, r.text
    png = Image.open(io.BytesIO(base64.b64decode(r.json()["results"][0]["overlay_png"])))
    assert png.format == "PNG" and png.size == (120, 80)


async def test_attention_and_plain_requests_share_a_batch(make_client: ClientFactory, shape_png: bytes) -> None:
    async with make_client(max_batch_size=8, max_wait_ms=0) as client:
        batcher = client.app.state.data_plane.default.batcher  # type: ignore[attr-defined]
        real, gate, loop = batcher.run_batch, asyncio.Event(), asyncio.get_running_loop()
        entered = threading.Event()
        sizes: list[int] = []

        def held(batch):  # type: ignore[no-untyped-def]
            if not entered.is_set():  # hold the first batch until both requests below are queued behind it
                entered.set()
                asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
            sizes.append(len(batch))
            return real(batch)

        batcher.run_batch = held
        blocker = asyncio.create_task(client.post("/predict", files={"file": ("x.png", shape_png, "image/png")}))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        plain = asyncio.create_task(client.post("/predict", files={"file": ("a.png", shape_png, "image/png")}))
        with_map = asyncio.create_task(
            client.post("/predict", files={"file": ("b.png", shape_png, "image/png")}, params={"attention": "last"})
        )
        while batcher.queue_depth < 2:
            await asyncio.sleep(0.005)
        gate.set()
        _, a, b = await asyncio.gather(blocker, plain, with_map)
        assert a.status_code == b.status_code == 200
        assert sizes == [1, 2]  # one forward pass served both the plain and the attention request
        assert "attention" not in a.json()["results"][0] and "attention" in b.json()["results"][0]
        assert a.json()["results"][0]["probabilities"] == pytest.approx(
            b.json()["results"][0]["probabilities"], abs=1e-5
        )


async def test_concurrent_burst_is_batched(make_client: ClientFactory, shape_png: bytes) -> None:
    async with make_client(max_batch_size=16, max_wait_ms=100) as client:
        responses = await asyncio.gather(
            *(client.post("/predict", files={"file": (f"{i}.png", shape_png, "image/png")}) for i in range(32))
        )
        assert all(r.status_code == 200 for r in responses)
        text = (await client.get("/metrics")).text
        batches = metric(text, "vit_batch_size_count", TINY_MODEL)
        images = metric(text, "vit_batch_size_sum", TINY_MODEL)
        assert images == 32 and batches < 32  # some forward passes carried several images
        assert metric(text, "vit_images_processed_total", TINY_MODEL) == 32


async def test_model_info(client: httpx.AsyncClient, tiny_checkpoint: Path) -> None:
    r = await client.get("/v1/model")
    assert r.status_code == 200, r.text
    info = r.json()
    ckpt = load_checkpoint(tiny_checkpoint)
    assert info["classes"] == SHAPE_CLASSES
    assert info["input_size"] == [32, 32] and info["channels"] == 3
    assert info["config"] == ckpt.config.to_dict()
    assert info["content_hash"] == ckpt.content_hash and info["version"] == numeric_version(ckpt.content_hash)
    assert info["training"] == {"dataset": "shapes", "seed": 0}
    assert info["device"] == "cpu" and info["dtype"] == "float32"


async def test_health_and_metrics(client: httpx.AsyncClient, shape_png: bytes) -> None:
    assert (await client.get("/health/live")).json() == {"status": "ok"}
    assert (await client.get("/health/ready")).status_code == 200
    await client.post("/predict", files={"file": ("a.png", shape_png, "image/png")})
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert metric(r.text, "vit_requests_total", '{protocol="http",route="/predict",status="200"}') == 1
    assert metric(r.text, "vit_requests_in_flight", '{protocol="http",route="/predict"}') == 0  # answered
    assert metric(r.text, "vit_requests_in_flight", '{protocol="http",route="/metrics"}') == 1  # this one
    for name in (
        "vit_request_latency_seconds_bucket",
        "vit_inference_seconds_count",
        "vit_queue_depth",
        "vit_images_processed_total",
    ):
        assert name in r.text


async def test_the_owners_start_freezes_the_heap_and_garbage_collections_are_timed(
    tiny_checkpoint: Path, make_client: ClientFactory
) -> None:
    """`python -m app`, the engine process and the batch runner start their engine with freeze_heap; an app
    in another program (this test's other clients) leaves its collector alone."""
    import gc

    def collections(text: str) -> float:
        found = re.search(r'^vit_gc_pause_seconds_count\{generation="2"\} (\S+)$', text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    settings = Settings(weights=tiny_checkpoint, device="cpu", backend="torch")
    async with Engine.serving(settings, freeze_heap=True) as engine:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert gc.get_freeze_count() > 10_000  # torch, the app and the model: out of every full collection's walk
            before = collections((await client.get("/metrics")).text)
            gc.collect()
            assert collections((await client.get("/metrics")).text) == before + 1
    assert gc.get_freeze_count() == 0  # given back to the collector at shutdown
    async with make_client() as client:
        assert gc.get_freeze_count() == 0
        before = collections((await client.get("/metrics")).text)
        gc.collect()
        assert collections((await client.get("/metrics")).text) == before + 1  # timed all the same


async def test_request_id_is_echoed_or_made(client: httpx.AsyncClient) -> None:
    r = await client.get("/health/live", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = await client.get("/health/live", headers={"x-request-id": "bad id with spaces"})
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    made = {(await client.get("/health/live")).headers["x-request-id"] for _ in range(20)}
    assert len(made) == 20 and all(re.fullmatch(r"[0-9a-f]{32}", m) for m in made)


def test_made_request_ids_differ_across_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked front-end draws its own random half: two processes never count the same ids."""
    ids = RequestIds()
    first = ids.next()
    monkeypatch.setattr(os, "getpid", lambda: -2)  # as in a process forked from this one
    second = ids.next()
    assert first[:16] != second[:16] and first[16:] == second[16:] == f"{0:016x}"


async def test_openapi_documents_the_api(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    predict = spec["paths"]["/predict"]["post"]
    assert {"multipart/form-data", "image/*"} <= set(predict["requestBody"]["content"])
    assert {p["name"] for p in predict["parameters"]} == {
        "top_k",
        "attention",
        "overlay",
        "model",
        "target",
        "embedding",
        "normalize",
        "ood",
        "labels",
        "label",
        "template",
        "head",
    }
    assert "/v1/models/{name}/heads" in spec["paths"]
    label = next(p for p in predict["parameters"] if p["name"] == "label")
    assert label["schema"]["type"] == "array"  # repeated: label=a&label=b
    top_k = next(p for p in predict["parameters"] if p["name"] == "top_k")
    assert top_k["in"] == "query" and not top_k["required"]
    assert top_k["schema"] | {"description": ""} == {
        "type": "integer",
        "minimum": 1,
        "maximum": 1000,
        "default": 5,
        "title": "Top K",
        "description": "",
    }
    assert {"200", "413", "415", "422", "503", "504"} <= set(predict["responses"])
    for path in ("/v1/model", "/v1/models", "/health/live", "/health/ready", "/metrics"):
        assert path in spec["paths"]
    assert (await client.get("/docs")).status_code == 200


async def test_gradient_maps_per_image_and_per_target(client: httpx.AsyncClient) -> None:
    images = [encode(make_sample(20261121, i).image) for i in range(3)]
    files = [("files", (f"{i}.png", png, "image/png")) for i, png in enumerate(images)]
    batch = (await client.post("/predict", files=files, params={"attention": "gradient"})).json()["results"]
    for i, png in enumerate(images):
        alone = await client.post(
            "/predict", files={"file": ("a.png", png, "image/png")}, params={"attention": "gradient"}
        )
        assert alone.status_code == 200, alone.text
        assert batch[i]["attention"]["method"] == "gradient" and batch[i]["attention"]["grid"] == [4, 4]
        in_batch, on_its_own = batch[i]["attention"]["map"], alone.json()["results"][0]["attention"]["map"]
        torch.testing.assert_close(torch.tensor(in_batch), torch.tensor(on_its_own), atol=1e-4, rtol=0)
    by_label = await client.post("/predict", files=files[:1], params={"attention": "gradient", "target": "star"})
    by_index = await client.post("/predict", files=files[:1], params={"attention": "gradient", "target": "5"})
    assert by_label.json()["results"][0]["attention"] == by_index.json()["results"][0]["attention"]
    overlay = await client.post("/predict", files=files[:1], params={"attention": "gradient", "overlay": "true"})
    assert overlay.json()["results"][0]["overlay_png"]


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (
            {"attention": "gradient", "target": "unicorn"},
            "target 'unicorn' names no class of model tiny; give a label or an index 0..9: circle, square",
        ),
        ({"attention": "gradient", "target": "10"}, "target '10' names no class"),
        (
            {"attention": "rollout", "target": "star"},
            "target chooses the class a gradient map explains: also pass attention=gradient",
        ),
        ({"target": "3"}, "also pass attention=gradient"),
    ],
)
async def test_target_errors_are_422(
    client: httpx.AsyncClient, shape_png: bytes, params: dict[str, str], fragment: str
) -> None:
    r = await client.post("/predict", files={"file": ("a.png", shape_png, "image/png")}, params=params)
    assert r.status_code == 422 and fragment in r.json()["detail"], r.text


@pytest.mark.parametrize(
    "variant",
    [
        {"norm": "post"},
        {"head": "mlp"},
        {"attention_pattern": "axial"},
        {"attention_pattern": "axial", "class_token": False, "pool": "avg", "reg_tokens": 1},
    ],
)
async def test_variants_serve_every_map(
    make_client: ClientFactory, tmp_path: Path, shape_png: bytes, variant: dict[str, object]
) -> None:
    path = tmp_path / "variant.safetensors"
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), **variant}))
    save_checkpoint(path, model, list(SHAPE_CLASSES), TINY_PREPROCESSING)
    async with make_client(weights=path) as client:
        config = (await client.get("/v1/model")).json()["config"]
        assert {k: config[k] for k in variant} == variant
        for method in ("rollout", "last", "gradient"):
            r = await client.post(
                "/predict", files={"file": ("a.png", shape_png, "image/png")}, params={"attention": method}
            )
            assert r.status_code == 200, r.text
            grid = r.json()["results"][0]["attention"]["map"]
            assert len(grid) == 4 and all(0.0 <= v <= 1.0 for row in grid for v in row)


async def test_v2_gradient_maps_with_a_target(client: httpx.AsyncClient, shape_png: bytes) -> None:
    body = {
        "parameters": {"attention": "gradient", "target": "star"},
        "inputs": [
            {"name": "image", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(shape_png).decode()]}
        ],
    }
    r = await client.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 200, r.text
    maps = next(o for o in r.json()["outputs"] if o["name"] == "attention")
    assert maps["shape"] == [1, 4, 4]
    body["parameters"] = {"attention": "rollout", "target": "star"}
    r = await client.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 400 and "also pass attention=gradient" in r.json()["error"]


@pytest.mark.parametrize("jpeg_draft", [True, False])
async def test_a_large_jpeg_is_decoded_as_vit_jpeg_draft_says(
    make_client: ClientFactory, tiny_checkpoint: Path, jpeg_draft: bool
) -> None:
    """The tiny checkpoint resizes to 32 px: a 400x300 JPEG decodes at 1/8 scale (50x38) unless turned off;
    the answer is the model's on that decode, and an overlay is drawn on the image as sent."""
    from app.core.images.decode import decode_image
    from app.core.images.prepare import Preprocessor

    rng = torch.Generator().manual_seed(0)
    pixels = (torch.rand(300, 400, 3, generator=rng) * 255).to(torch.uint8).numpy()
    jpeg = encode(Image.fromarray(pixels), "JPEG", quality=90)
    ckpt = load_checkpoint(tiny_checkpoint)
    draft_to = 32 if jpeg_draft else None
    decoded = decode_image(jpeg, "p.jpg", 3, 40_000_000, draft_to)
    assert decoded.size == ((50, 38) if jpeg_draft else (400, 300))
    with torch.inference_mode():
        expected = ckpt.model(Preprocessor(ckpt.preprocessing)(decoded)[None]).softmax(-1)[0]
    async with make_client(jpeg_draft=jpeg_draft) as client:
        r = await client.post("/predict", content=jpeg, headers={"content-type": "image/jpeg"})
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["probabilities"] == pytest.approx(expected.tolist(), abs=1e-5)
        r = await client.post(
            "/predict",
            content=jpeg,
            headers={"content-type": "image/jpeg"},
            params={"attention": "rollout", "overlay": "true"},
        )
        assert r.status_code == 200, r.text
        png = Image.open(io.BytesIO(base64.b64decode(r.json()["results"][0]["overlay_png"])))
        assert png.size == (256, 192)  # the 400x300 image at the overlay's 256 px cap, not the 50x38 decode


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"atention": "rollout"}, "atention"),  # misspelt: never silently ignored
        ({"overlay": "true"}, "overlay=true draws an attention map: also pass attention=rollout"),
        ({"normalize": "true"}, "normalize=true L2-normalises the embedding: also pass embedding=true"),
        ({"ood": "true"}, "has no reference statistics to score images by"),
    ],
)
async def test_a_query_parameter_asking_for_what_cannot_be_given_is_a_422_that_says_why(
    client: httpx.AsyncClient, shape_png: bytes, params: dict[str, str], fragment: str
) -> None:
    r = await client.post("/predict", files={"file": ("a.png", shape_png, "image/png")}, params=params)
    assert r.status_code == 422 and fragment in json.dumps(r.json()["detail"]), r.text


async def test_a_max_softmax_reference_scores_one_minus_the_top_probability(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    """A checkpoint whose statistics say max_softmax (a model trained with outlier exposure): ood_score is 1 - the
    top probability, the p99 is that score's, and /v1/models says which score it is."""
    from model.reference import fit

    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 3, 32, 32, generator=g)
    with torch.inference_mode():
        logits, embeddings, _ = model.forward_with_embedding(x)
    probabilities = logits.softmax(-1)
    reference = fit(embeddings, logits.argmax(-1), 10, score="max_softmax", probabilities=probabilities)
    path = tmp_path / "outliers.safetensors"
    save_checkpoint(path, model, list(SHAPE_CLASSES), TINY_PREPROCESSING, reference=reference)
    images = [("files", (f"{i}.png", encode(make_sample(3, i).image), "image/png")) for i in range(3)]
    async with make_client(weights=path) as client:
        r = await client.post("/predict", files=images, params={"ood": "true"})
        info = (await client.get("/v1/models")).json()["models"][0]
    assert r.status_code == 200, r.text
    for result in r.json()["results"]:
        assert result["ood_score"] == pytest.approx(1 - max(result["probabilities"]), abs=1e-6)
    assert info["ood_method"] == "max_softmax" and info["ood_p99"] == pytest.approx(reference.held_out_p99)


QUERIES = [
    "",
    "top_k=3&attention=rollout&overlay=true",
    "top_k=3&top_k=7",  # a plain field repeated: the last value
    "embedding=1&normalize=yes&ood=false&model=tiny",
    "labels=cat,dog&label=a%2C+b&label=c&template=a+photo+of+a+%7B%7D.",
    "label=",
    "top_k=",
    "top_k=0",
    "top_k=abc&attention=sideways&overlay=maybe",
    "atention=rollout",  # misspelt
    "x=1&x=2&y=3&top_k=1001",
    "target=3&attention=gradient&target=cat",
]


@pytest.mark.parametrize("query", QUERIES)
def test_predicts_query_is_read_as_fastapi_reads_its_model(query: str) -> None:
    """`/predict`'s route reads its query itself (`read_query`); FastAPI, reading the same model as a `Query()`
    parameter of a route of its own, gives the same values, or the same errors in the same order."""

    def errors(exc: RequestValidationError) -> list[tuple[Any, ...]]:
        return [(tuple(e["loc"]), e["type"], e["msg"], e.get("input")) for e in exc.errors()]

    app = FastAPI()

    @app.get("/q")
    async def q(query: Annotated[PredictQuery, Query()]) -> dict[str, Any]:
        return query.model_dump()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Any, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"errors": [list(e) for e in errors(exc)]}, status_code=422)

    theirs = TestClient(app).get(f"/q?{query}").json()
    try:
        ours: dict[str, Any] = read_query(QueryParams(query)).model_dump()
    except RequestValidationError as e:
        ours = {"errors": [list(error) for error in errors(e)]}
    assert json.loads(json.dumps(ours)) == theirs
    if query.startswith("atention") or "top_k=0" in query:
        assert "errors" in theirs  # the battery has bad queries, whose errors are compared


def test_predicts_route_resolves_all_its_endpoint_asks_for() -> None:
    """`PredictEndpointRoute` calls the endpoint with the request, the plane and the query, and runs nothing else:
    FastAPI's own reading of the endpoint finds exactly those, and no dependency of the route or its routers, which
    the route would skip."""
    (route,) = [r for r in router.routes if getattr(r, "path", "") == "/predict"]
    assert isinstance(route, PredictEndpointRoute)
    asked = route.dependant
    assert [d.call for d in asked.dependencies] == [authorized_data_plane]
    assert [p.name for p in asked.query_params] == ["query"] and asked.request_param_name == "request"
    assert not (asked.path_params or asked.header_params or asked.cookie_params or asked.body_params)
    app = create_app(MagicMock())  # only its routers are read
    assert route.dependencies == router.dependencies == app.router.dependencies == []
