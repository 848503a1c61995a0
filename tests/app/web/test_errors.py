from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from app.core.engine.engine import Engine
from app.settings import Settings
from app.web.app import create_app
from harness.images import encode, png_with_header
from model.shapes import make_sample
from tests.support.clients import ClientFactory, until
from tests.support.data_planes import UnreadyDataPlane


async def post_file(
    client: httpx.AsyncClient, data: bytes, name: str = "x.png", ctype: str = "image/png", **params: str
) -> httpx.Response:
    return await client.post("/predict", files={"file": (name, data, ctype)}, params=params)


def assert_error(r: httpx.Response, status: int, *fragments: str) -> None:
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str)
    for f in fragments:
        assert f in detail, detail


async def test_body_over_the_limit_is_413(make_client: ClientFactory) -> None:
    async with make_client(max_upload_bytes=2000) as client:
        big = encode(Image.effect_noise((64, 64), 50).convert("RGB"))
        assert len(big) > 2000
        assert_error(await post_file(client, big), 413, "over the limit of 2000 bytes")
        r = await client.post("/predict", content=big, headers={"content-type": "image/png"})
        assert_error(r, 413, "2000 bytes")


async def test_image_over_the_pixel_limit_is_413_without_decoding(make_client: ClientFactory) -> None:
    async with make_client(max_image_pixels=10_000) as client:
        assert_error(
            await post_file(client, png_with_header(100_000, 100_000), "bomb.png"),
            413,
            "bomb.png",
            "10000000000 pixels",
        )
        assert_error(await post_file(client, encode(Image.new("RGB", (200, 100)))), 413, "200x100")


@pytest.mark.parametrize(
    ("data", "name", "ctype", "fragment"),
    [
        (b"hello, I am text", "note.png", "image/png", "not a recognised image"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "v.svg", "image/svg+xml", "not a recognised image"),
    ],
)
async def test_not_an_image_is_415(
    client: httpx.AsyncClient, data: bytes, name: str, ctype: str, fragment: str
) -> None:
    assert_error(await post_file(client, data, name, ctype), 415, name, fragment)


async def test_tiff_is_415(client: httpx.AsyncClient) -> None:
    assert_error(
        await post_file(client, encode(Image.new("RGB", (8, 8)), "TIFF"), "t.tif"), 415, "TIFF images are not supported"
    )


async def test_wrong_content_type_is_415(client: httpx.AsyncClient) -> None:
    r = await client.post("/predict", content=b"{}", headers={"content-type": "application/json"})
    assert_error(r, 415, "multipart/form-data", "image/*")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
async def test_truncated_image_is_422(client: httpx.AsyncClient, fmt: str) -> None:
    data = encode(make_sample(0, 1).image, fmt)
    cut = data[: len(data) * 3 // 4]  # past the header (a small JPEG's tables fill half of it), short of the end
    assert_error(await post_file(client, cut, "cut.img"), 422, "cut.img", "truncated or corrupted")


async def test_empty_file_is_422(client: httpx.AsyncClient) -> None:
    assert_error(await post_file(client, b"", "empty.png"), 422, "empty.png", "empty")


async def test_one_bad_image_fails_the_request_naming_it(client: httpx.AsyncClient, shape_png: bytes) -> None:
    files = [("files", ("good.png", shape_png, "image/png")), ("files", ("bad.png", b"garbage", "image/png"))]
    assert_error(await client.post("/predict", files=files), 415, "bad.png")
    assert (await client.get("/health/ready")).status_code == 200


async def test_too_many_files_is_422(make_client: ClientFactory, shape_png: bytes) -> None:
    async with make_client(max_files=2) as client:
        files = [("files", (f"{i}.png", shape_png, "image/png")) for i in range(3)]
        assert_error(await client.post("/predict", files=files), 422, "Maximum number of files is 2")


async def test_no_file_and_wrong_field_are_422(client: httpx.AsyncClient, shape_png: bytes) -> None:
    assert_error(await client.post("/predict", data={"note": "hi"}, files={}), 415)  # urlencoded: not multipart
    r = await client.post("/predict", files={"image": ("a.png", shape_png, "image/png")})
    assert_error(r, 422, "unexpected file field 'image'", "'file'")
    r = await client.post("/predict", data={"note": "hi"}, files=[("ignored", ("", b"", "text/plain"))])
    assert r.status_code == 422, r.text


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"top_k": "0"}, "top_k"),
        ({"top_k": "many"}, "top_k"),
        ({"attention": "gradcam"}, "attention"),
        ({"overlay": "maybe"}, "overlay"),
        ({"overlay": "true"}, "attention=rollout"),
        ({"top_k": "0", "attention": "x"}, "top_k: Input should be greater than or equal to 1; attention: "),
    ],
)
async def test_bad_query_is_422(
    client: httpx.AsyncClient, shape_png: bytes, params: dict[str, str], fragment: str
) -> None:
    assert_error(await post_file(client, shape_png, **params), 422, fragment)


async def test_overloaded_is_503_with_retry_after(make_client: ClientFactory, shape_png: bytes) -> None:
    async with make_client(max_queue=2, max_files=2, max_batch_size=1, max_wait_ms=0) as client:
        batcher = client.app.state.data_plane.default.batcher  # type: ignore[attr-defined]
        original = batcher.run_batch
        release, entered = asyncio.Event(), threading.Event()
        loop = asyncio.get_running_loop()

        def slow(batch):  # type: ignore[no-untyped-def]
            entered.set()
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
            return original(batch)

        batcher.run_batch = slow
        pending = [asyncio.create_task(post_file(client, shape_png))]  # computing, held
        await until(entered.is_set)
        for depth in (1, 2):  # then two more fill the queue
            pending.append(asyncio.create_task(post_file(client, shape_png)))
            await until(lambda d=depth: batcher.queue_depth == d)  # type: ignore[misc]
        r = await post_file(client, shape_png)
        assert_error(r, 503, "overloaded")
        assert int(r.headers["retry-after"]) >= 1
        release.set()
        assert [p.status_code for p in await asyncio.gather(*pending)] == [200, 200, 200]


async def test_timeout_is_504(make_client: ClientFactory, shape_png: bytes) -> None:
    async with make_client(request_timeout_s=0.2) as client:
        batcher = client.app.state.data_plane.default.batcher  # type: ignore[attr-defined]
        original = batcher.run_batch

        def slow(batch):  # type: ignore[no-untyped-def]
            import time

            time.sleep(0.5)
            return original(batch)

        batcher.run_batch = slow
        assert_error(await post_file(client, shape_png), 504, "VIT_REQUEST_TIMEOUT_S")


async def test_not_ready_before_the_model_is_loaded(tiny_checkpoint: Path, shape_png: bytes) -> None:
    engine = Engine.load(Settings(weights=tiny_checkpoint, device="cpu", backend="torch"))  # loaded, not started
    app = create_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.get("/health/live")).status_code == 200
        assert_error(await client.get("/health/ready"), 503, "not ready")
        assert_error(await post_file(client, shape_png), 503, "not loaded yet")
        assert_error(await client.get("/v1/model"), 503)
        assert (await client.get("/metrics")).status_code == 200
        engine.start()
        try:
            assert (await client.get("/health/ready")).status_code == 200
        finally:
            await engine.shutdown()
        assert_error(await client.get("/health/ready"), 503, "draining")


async def test_the_edges_ask_only_the_data_plane(shape_png: bytes) -> None:
    """/predict, V2 REST and the health routes run over a data plane that is not the engine."""
    plane = UnreadyDataPlane()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(plane)), base_url="http://test") as c:
        assert (await c.get("/health/live")).status_code == 200
        assert (await c.get("/v2/health/live")).status_code == 200
        assert_error(await c.get("/health/ready"), 503, "not loaded yet")
        assert_error(await post_file(c, shape_png), 503, "not loaded yet")
        r = await c.post("/v2/models/m/infer", json={"inputs": []})
        assert r.status_code == 503 and "not loaded yet" in r.json()["error"]
        assert (await c.get("/metrics")).status_code == 200
    assert plane.calls == ["check_taking"] * 2  # /predict and V2 infer; readiness asks ready()


async def test_api_keys_guard_predict_only(make_client: ClientFactory, shape_png: bytes) -> None:
    async with make_client(api_keys="k1, k2") as client:
        assert_error(await post_file(client, shape_png), 401, "X-API-Key")
        assert_error(await post_file(client, shape_png, top_k="0"), 401, "X-API-Key")  # the key before the query
        r = await client.post(
            "/predict", files={"file": ("a.png", shape_png, "image/png")}, headers={"x-api-key": "wrong"}
        )
        assert r.status_code == 401
        r = await client.post(
            "/predict", files={"file": ("a.png", shape_png, "image/png")}, headers={"x-api-key": "k2"}
        )
        assert r.status_code == 200, r.text
        r = await client.post(
            "/predict", files={"file": ("a.png", shape_png, "image/png")}, headers={"authorization": "Bearer k1"}
        )
        assert r.status_code == 200, r.text
        assert (await client.get("/health/ready")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


async def test_unknown_route_is_json_404(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/nope"), 404, "Not Found")


def test_bad_settings_are_clear() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="VIT_DEVICE must be auto, cpu, cuda or cuda:N"):
        Settings(device="gpu")
    with pytest.raises(ValidationError, match="VIT_MAX_QUEUE"):
        Settings(max_queue=2, max_files=4)
    with pytest.raises(ValidationError):
        Settings(max_batch_size=0)


async def test_an_unexpected_error_is_a_500_and_counted_as_one(make_client: ClientFactory) -> None:
    async with make_client() as served:
        app = served.app  # type: ignore[attr-defined]

        async def broken(request: object, encode: object) -> bytes:
            raise RuntimeError("a bug (simulated)")

        app.state.data_plane.infer = broken
        # Starlette's outermost middleware answers the 500, then re-raises for the server to log
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            png = encode(make_sample(1, 0).image)
            r = await client.post(
                "/predict", files={"file": ("x.png", png, "image/png")}, headers={"x-request-id": "r1"}
            )
            assert_error(r, 500, "internal error; quote request id r1")
            assert "a bug" not in r.text and "Traceback" not in r.text
            metrics = (await client.get("/metrics")).text
    counted = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "vit_requests"
        for sample in family.samples
        if sample.name == "vit_requests_total" and sample.labels["route"] == "/predict"
    }
    assert counted == {"500": 1.0}  # as answered, not as a client that left (499)
