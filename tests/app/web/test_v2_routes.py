"""Open Inference Protocol routes in process: every malformed request is a 4xx {"error": ...} saying what to
fix; V2 shares the /predict path's batcher, limits, API keys and overload answers."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading
from typing import Any
from unittest.mock import MagicMock

import httpx
import numpy as np
import pytest

from app.web.app import create_app
from app.web.dependencies import authorized_data_plane
from app.web.v2_routes import V2InferRoute
from app.web.v2_routes import router as v2_router
from tests.support.clients import ClientFactory

INFER = "/v2/models/tiny/infer"


def bytes_tensor(*files: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(f)) + f for f in files)


async def infer_binary(client: httpx.AsyncClient, header: dict[str, Any], binary: bytes, **kw: Any) -> httpx.Response:
    head = json.dumps(header).encode()
    headers = {"Inference-Header-Content-Length": str(len(head)), **kw.pop("headers", {})}
    return await client.post(INFER, content=head + binary, headers=headers, **kw)


def image_request(*files: bytes, **extra: Any) -> tuple[dict[str, Any], bytes]:
    binary = bytes_tensor(*files)
    tensor = {
        "name": "image",
        "datatype": "BYTES",
        "shape": [len(files)],
        "parameters": {"binary_data_size": len(binary)},
    }
    return {"inputs": [tensor], **extra}, binary


def assert_v2_error(r: httpx.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and fragment in body["error"], body


async def test_json_request_with_base64_images_and_classification(client: httpx.AsyncClient, shape_png: bytes) -> None:
    body = {
        "id": "abc",
        "parameters": {"attention": "rollout"},
        "inputs": [
            {
                "name": "image",
                "datatype": "BYTES",
                "shape": [2, 1],
                "data": [[base64.b64encode(shape_png).decode()]] * 2,
            }
        ],
        "outputs": [{"name": "probabilities", "parameters": {"classification": 2}}, {"name": "attention"}],
    }
    r = await client.post(INFER, json=body)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert r.json()["id"] == "abc" and r.json()["model_name"] == "tiny"
    assert out["probabilities"]["datatype"] == "BYTES" and out["probabilities"]["shape"] == [2, 2]
    score, index, label = out["probabilities"]["data"][0].split(":")
    assert (
        0 < float(score) <= 1
        and label
        == ["circle", "square", "triangle", "pentagon", "hexagon", "star", "cross", "ring", "crescent", "arrow"][
            int(index)
        ]
    )
    assert out["attention"]["shape"] == [2, 4, 4] and len(out["attention"]["data"]) == 32


async def test_every_output_named_comes_back_as_its_parameter_form_gives_it(
    client: httpx.AsyncClient, shape_png: bytes
) -> None:
    """Requested by name (as perf_analyzer requests each one the metadata lists), an output is computed with
    its defaults; the parameters still choose the kind of map and the rest."""
    image = {"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": [base64.b64encode(shape_png).decode()]}
    every = [{"name": "probabilities"}, {"name": "attention"}, {"name": "embedding"}]
    r = await client.post(INFER, json={"inputs": [image], "outputs": every})
    assert r.status_code == 200, r.text
    named = {o["name"]: o for o in r.json()["outputs"]}
    assert list(named) == ["probabilities", "attention", "embedding"]
    r = await client.post(INFER, json={"inputs": [image], "parameters": {"attention": "rollout", "embedding": True}})
    assert r.status_code == 200, r.text
    by_parameters = {o["name"]: o for o in r.json()["outputs"]}
    for name in named:
        assert named[name]["shape"] == by_parameters[name]["shape"]
        np.testing.assert_allclose(named[name]["data"], by_parameters[name]["data"], atol=1e-6)
    r = await client.post(
        INFER, json={"inputs": [image], "outputs": [{"name": "attention"}], "parameters": {"attention": "last"}}
    )
    assert r.status_code == 200, r.text
    assert [o["name"] for o in r.json()["outputs"]] == ["attention"]
    assert not np.allclose(r.json()["outputs"][0]["data"], named["attention"]["data"])  # last, not rollout


async def test_an_output_the_model_cannot_give_is_a_400_that_says_why(
    client: httpx.AsyncClient, shape_png: bytes
) -> None:
    image = {"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": [base64.b64encode(shape_png).decode()]}
    r = await client.post(INFER, json={"inputs": [image], "outputs": [{"name": "ood_score"}]})
    assert_v2_error(r, 400, "has no reference statistics to score images by")
    r = await client.post(INFER, json={"inputs": [image], "outputs": [{"name": "logits"}]})
    assert_v2_error(r, 400, "unknown output 'logits'; this model gives 'probabilities', 'attention', 'embedding'")


async def test_probabilities_alone_where_the_server_lists_only_them(
    make_client: ClientFactory, shape_png: bytes
) -> None:
    image = {"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": [base64.b64encode(shape_png).decode()]}
    async with make_client(v2_outputs="probabilities") as client:
        meta = (await client.get("/v2/models/tiny")).json()
        assert [o["name"] for o in meta["outputs"]] == ["probabilities"]
        config = (await client.get("/v2/models/tiny/config")).json()
        assert [o["name"] for o in config["output"]] == ["probabilities"]
        every = [{"name": "probabilities"}]
        r = await client.post(INFER, json={"inputs": [image], "outputs": every})
        assert r.status_code == 200 and [o["name"] for o in r.json()["outputs"]] == ["probabilities"]
        r = await client.post(INFER, json={"inputs": [image], "outputs": [{"name": "attention"}]})
        assert_v2_error(r, 400, "output 'attention' is not served here (VIT_V2_OUTPUTS=probabilities)")
        r = await client.post(INFER, json={"inputs": [image], "parameters": {"embedding": True}})
        assert_v2_error(r, 400, "the parameter embedding asks for an output this server does not give")


async def test_binary_outputs_follow_the_json_header(client: httpx.AsyncClient, shape_png: bytes) -> None:
    header, binary = image_request(shape_png, parameters={"binary_data_output": True})
    r = await infer_binary(client, header, binary)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    n = int(r.headers["inference-header-content-length"])
    meta = json.loads(r.content[:n])
    (probabilities,) = meta["outputs"]
    assert probabilities["parameters"]["binary_data_size"] == 40 and len(r.content) == n + 40
    values = np.frombuffer(r.content[n:], dtype="<f4")
    assert values.shape == (10,) and abs(float(values.sum()) - 1.0) < 1e-5


async def test_v2_and_predict_images_share_one_batch(make_client: ClientFactory, shape_png: bytes) -> None:
    async with make_client(max_batch_size=8, max_wait_ms=200) as client:
        batcher = client.app.state.data_plane.default.batcher  # type: ignore[attr-defined]
        sizes: list[int] = []
        original = batcher.run_batch
        gate = threading.Event()

        def run(batch):  # type: ignore[no-untyped-def]
            sizes.append(len(batch))
            if len(sizes) == 1:
                gate.wait(10)  # the first batch holds the forward thread while the two requests queue
            return original(batch)

        batcher.run_batch = run
        first = asyncio.create_task(client.post("/predict", files={"file": ("first.png", shape_png, "image/png")}))
        while not sizes:
            await asyncio.sleep(0.01)
        header, binary = image_request(shape_png, shape_png)
        both = asyncio.gather(
            infer_binary(client, header, binary),
            client.post("/predict", files={"file": ("a.png", shape_png, "image/png")}),
        )
        while batcher.queue_depth < 3:
            await asyncio.sleep(0.01)
        gate.set()
        v2, predict = await both
        assert (await first).status_code == 200
        assert v2.status_code == 200 and predict.status_code == 200
        assert sizes == [1, 3]  # two V2 images and one /predict image in one forward pass
        v2_probs = v2.json()["outputs"][0]["data"][:10]
        assert v2_probs == pytest.approx(predict.json()["results"][0]["probabilities"], abs=1e-6)


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        ({"inputs": "x"}, 400, "invalid inference request: inputs"),
        ({"inputs": []}, 400, "send exactly one input"),
        (
            {"inputs": [{"name": "img", "datatype": "BYTES", "shape": [1], "data": ["aGk="]}]},
            400,
            "unknown input 'img'",
        ),
        ({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, 400, "must be BYTES"),
        (
            {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "b"]}]},
            400,
            "shape [N] or [N, 1]",
        ),
        (
            {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2], "data": ["aGk="]}]},
            400,
            "says 2 images, the data holds 1",
        ),
        ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["@@@"]}]}, 400, "is not base64"),
        (
            {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["aGk="]}]},
            400,
            "image[0]: not a recognised image",
        ),
        ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [0], "data": []}]}, 400, "has no images"),
        ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [17], "data": ["aGk="] * 17}]}, 400, "at most 16"),
        (
            {"inputs": [{"name": "pixels", "datatype": "FP16", "shape": [1, 3, 32, 32], "data": [0]}]},
            400,
            "must be FP32",
        ),
        (
            {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 1, 32, 32], "data": [0]}]},
            400,
            "must have shape [-1, 3, 32, 32]",
        ),
        (
            {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [0.0] * 5}]},
            400,
            "needs 3072 values, the data holds 5",
        ),
        (
            {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": ["x"] * 3072}]},
            400,
            "data must be numbers",
        ),
        (
            {
                "inputs": [
                    {"name": "pixels", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [float("nan")] * 3072}
                ]
            },
            400,
            "NaN or infinite",
        ),
        (
            {
                "parameters": {"attention": "gradcam"},
                "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [0.0] * 3072}],
            },
            400,
            "attention must be one of",
        ),
        (
            {
                "outputs": [{"name": "logits"}],
                "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [0.0] * 3072}],
            },
            400,
            "unknown output 'logits'",
        ),
        (
            {
                "outputs": [{"name": "probabilities", "parameters": {"classification": -1}}],
                "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [0.0] * 3072}],
            },
            400,
            "non-negative integer",
        ),
    ],
)
async def test_malformed_requests_are_400_with_what_to_fix(
    client: httpx.AsyncClient, body: Any, status: int, fragment: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    assert_v2_error(await client.post(INFER, content=content), status, fragment)


@pytest.mark.parametrize(
    ("binary", "size", "header_length", "fragment"),
    [
        (bytes_tensor(b"abc")[:2], None, None, "ends inside the length prefix"),
        (struct.pack("<I", 100) + b"abc", None, None, "claims 100 bytes, only 3 remain"),
        (bytes_tensor(b"abc"), 3, None, "binary_data_size 3 does not match the 7 bytes"),
        (bytes_tensor(b"abc"), None, "99999", "Inference-Header-Content-Length '99999'"),
        (bytes_tensor(b"abc"), None, "x", "Inference-Header-Content-Length 'x'"),
    ],
)
async def test_malformed_binary_data_is_400(
    client: httpx.AsyncClient, binary: bytes, size: int | None, header_length: str | None, fragment: str
) -> None:
    header = {
        "inputs": [
            {
                "name": "image",
                "datatype": "BYTES",
                "shape": [1],
                "parameters": {"binary_data_size": size if size is not None else len(binary)},
            }
        ]
    }
    head = json.dumps(header).encode()
    r = await client.post(
        INFER, content=head + binary, headers={"Inference-Header-Content-Length": header_length or str(len(head))}
    )
    assert_v2_error(r, 400, fragment)


async def test_binary_pixels_must_have_the_right_size(client: httpx.AsyncClient) -> None:
    data = np.zeros((1, 3, 32, 32), "<f4").tobytes()[:-4]
    header = {
        "inputs": [
            {
                "name": "pixels",
                "datatype": "FP32",
                "shape": [1, 3, 32, 32],
                "parameters": {"binary_data_size": len(data)},
            }
        ]
    }
    assert_v2_error(await infer_binary(client, header, data), 400, "needs 12288 bytes of FP32, got 12284")


async def test_models_and_versions(client: httpx.AsyncClient) -> None:
    version = (await client.get("/v2/models/tiny")).json()["versions"][0]
    assert (await client.get(f"/v2/models/tiny/versions/{version}/ready")).json() == {"name": "tiny", "ready": True}
    assert_v2_error(await client.get("/v2/models/tiny/versions/0000/ready"), 404, f"it serves version {version}")
    assert_v2_error(await client.get("/v2/models/other"), 404, "no model named 'other'; this service serves: tiny")
    assert (await client.get("/v2/health/live")).json() == {"live": True}
    assert (await client.get("/v2/health/ready")).json() == {"ready": True}
    assert_v2_error(await client.get("/v2/nothing-here"), 404, "Not Found")


async def test_infer_by_version(client: httpx.AsyncClient, shape_png: bytes) -> None:
    """The versioned infer route passes the path's version on: the served one answers, under that version; another
    is a 404 naming it; the model's name is checked on both routes."""
    version = (await client.get("/v2/models/tiny")).json()["versions"][0]
    header, binary = image_request(shape_png)
    head = json.dumps(header).encode()
    headers = {"Inference-Header-Content-Length": str(len(head))}
    r = await client.post(f"/v2/models/tiny/versions/{version}/infer", content=head + binary, headers=headers)
    assert r.status_code == 200 and r.json()["model_version"] == version, r.text
    r = await client.post("/v2/models/tiny/versions/0000/infer", content=head + binary, headers=headers)
    assert_v2_error(r, 404, f"it serves version {version}")
    r = await client.post("/v2/models/tiny/infer?version=0000", content=head + binary, headers=headers)
    assert_v2_error(r, 404, f"it serves version {version}")  # the unversioned route reads one from the query
    r = await client.post("/v2/models/other/infer", content=head + binary, headers=headers)
    assert_v2_error(r, 404, "no model named 'other'")


def test_infer_routes_resolve_all_their_endpoint_asks_for() -> None:
    """`V2InferRoute` calls the endpoint with the request, the plane and the path's name and version, and runs
    nothing else: FastAPI's own reading of the endpoint finds exactly those, and no dependency of the routes or their
    routers, which the routes would skip. They come first among V2's routes, which are matched in order."""
    infer_routes = [r for r in v2_router.routes if getattr(r, "path", "").endswith("/infer")]
    assert [r.path for r in v2_router.routes[:2]] == [  # type: ignore[attr-defined]
        "/v2/models/{name}/infer",
        "/v2/models/{name}/versions/{version}/infer",
    ]
    for route in infer_routes:
        assert isinstance(route, V2InferRoute)
        asked = route.dependant
        assert [d.call for d in asked.dependencies] == [authorized_data_plane]
        versioned = "{version}" in route.path
        assert [p.name for p in asked.path_params] == (["name", "version"] if versioned else ["name"])
        assert [p.name for p in asked.query_params] == ([] if versioned else ["version"])
        assert asked.request_param_name == "request"
        assert not (asked.header_params or asked.cookie_params or asked.body_params)
        assert route.dependencies == []
    app = create_app(MagicMock())  # only its routers are read
    assert v2_router.dependencies == app.router.dependencies == []


async def test_api_keys_guard_infer(make_client: ClientFactory, shape_png: bytes) -> None:
    async with make_client(api_keys="k1") as client:
        header, binary = image_request(shape_png)
        assert_v2_error(
            await infer_binary(client, header, binary),
            401,
            "missing or invalid API key; send it in the X-API-Key header, or as Authorization: Bearer KEY",
        )
        r = await infer_binary(client, header, binary, headers={"Authorization": "Bearer k1"})
        assert r.status_code == 200, r.text
        assert (await client.get("/v2/models/tiny")).status_code == 200  # metadata stays open, as /v1/model


async def test_body_limit_and_overload(make_client: ClientFactory, shape_png: bytes) -> None:
    async with make_client(
        max_upload_bytes=20_000, max_queue=2, max_files=2, max_batch_size=1, max_wait_ms=0
    ) as client:
        header, binary = image_request(b"x" * 30_000)
        assert_v2_error(await infer_binary(client, header, binary), 413, "over the limit of 20000 bytes")
        batcher = client.app.state.data_plane.default.batcher  # type: ignore[attr-defined]
        original, release, entered = batcher.run_batch, asyncio.Event(), threading.Event()
        loop = asyncio.get_running_loop()

        def held(batch):  # type: ignore[no-untyped-def]
            entered.set()
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
            return original(batch)

        batcher.run_batch = held
        header, binary = image_request(shape_png)
        first = asyncio.create_task(infer_binary(client, header, binary))
        while not entered.is_set():
            assert not first.done(), first.result().text
            await asyncio.sleep(0.005)
        header2, binary2 = image_request(shape_png, shape_png)
        queued = asyncio.create_task(infer_binary(client, header2, binary2))
        while batcher.queue_depth < 2:
            await asyncio.sleep(0.005)
        r = await infer_binary(client, header, binary)
        assert_v2_error(r, 503, "overloaded")
        assert int(r.headers["retry-after"]) >= 1
        release.set()
        assert [t.status_code for t in await asyncio.gather(first, queued)] == [200, 200]


async def test_v2_appears_in_the_openapi_schema(client: httpx.AsyncClient) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert {
        "/v2",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/{name}",
        "/v2/models/{name}/ready",
        "/v2/models/{name}/infer",
        "/v2/models/{name}/versions/{version}/infer",
    } <= set(paths)
    body = paths["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]
    assert {"application/json", "application/octet-stream"} <= set(body)


async def test_predict_and_v2_share_the_response_cache(make_client: ClientFactory, shape_png: bytes) -> None:
    """VIT_CACHE_BYTES: the same image through /predict, then V2 with other outputs asked for, is one miss
    and one hit; each answer keeps its own request's shape."""
    async with make_client(cache_bytes=1 << 20) as client:
        r = await client.post("/predict?top_k=2", files={"file": ("first.png", shape_png, "image/png")})
        assert r.status_code == 200 and len(r.json()["results"][0]["top_k"]) == 2
        header, binary = image_request(
            shape_png, outputs=[{"name": "probabilities", "parameters": {"classification": 3}}]
        )
        v2 = await infer_binary(client, header, binary)
        assert v2.status_code == 200, v2.text
        [out] = v2.json()["outputs"]
        assert out["shape"] == [1, 3]
        assert out["data"][0].split(":")[2] == r.json()["results"][0]["top_k"][0]["label"]
        metrics = (await client.get("/metrics")).text
        assert 'vit_cache_hits_total{model="tiny"} 1.0' in metrics
        assert 'vit_cache_misses_total{model="tiny"} 1.0' in metrics
        assert 'vit_images_processed_total{model="tiny"} 1.0' in metrics


async def test_an_output_parameter_the_service_does_not_know_is_a_400_that_names_it(
    client: httpx.AsyncClient, shape_png: bytes
) -> None:
    image = {"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": [base64.b64encode(shape_png).decode()]}
    wanted = [{"name": "probabilities", "parameters": {"class_count": 2}}]  # tritonclient's argument, sent raw
    r = await client.post(INFER, json={"inputs": [image], "outputs": wanted})
    assert_v2_error(r, 400, "output 'probabilities': unknown parameter 'class_count'; an output takes classification")
    wanted = [{"name": "probabilities", "parameters": {"classification": 2}}]
    r = await client.post(INFER, json={"inputs": [image], "outputs": wanted})
    assert r.status_code == 200 and r.json()["outputs"][0]["datatype"] == "BYTES", r.text


@pytest.mark.parametrize("regions", [0, 4])
async def test_system_shared_memory_is_listed_where_clients_may_register(
    make_client: ClientFactory, regions: int
) -> None:
    """VIT_SHARED_MEMORY_REGIONS=0 turns the extension off: /v2 does not advertise what it refuses."""
    async with make_client(shared_memory_regions=regions) as client:
        extensions = (await client.get("/v2")).json()["extensions"]
    assert ("system_shared_memory" in extensions) == (regions > 0) and "model_repository" in extensions


async def test_metrics_label_a_request_by_its_route_and_a_versioned_one_by_its_models(
    make_client: ClientFactory,
) -> None:
    """The route label is the template the router matched; a call naming a version counts under its model's
    route, as it always has, and a path no route has under `other`."""
    async with make_client() as client:
        version = (await client.get("/v2/models/tiny")).json()["versions"][0]
        assert (await client.get("/v2/models/tiny/ready")).status_code == 200
        assert (await client.get(f"/v2/models/tiny/versions/{version}/ready")).status_code == 200
        assert (await client.get("/v2/nothing-here")).status_code == 404
        text = (await client.get("/metrics")).text
    assert 'vit_requests_total{protocol="http",route="/v2/models/{name}/ready",status="200"} 2.0' in text
    assert 'vit_requests_total{protocol="http",route="/v2/models/{name}",status="200"} 1.0' in text
    assert 'vit_requests_total{protocol="http",route="other",status="404"} 1.0' in text
