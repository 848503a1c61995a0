"""Property-based fuzzing of /predict: random bytes and mutated valid images never yield a 5xx."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from app.core.engine.engine import Engine
from app.settings import Settings
from app.web.app import create_app
from harness.images import encode
from model.shapes import make_sample
from tests.support.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow
T = TypeVar("T")
CASES = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
CONTENT_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif", "application/octet-stream", "text/plain"]


def seed_images() -> list[bytes]:
    image = make_sample(11, 0).image
    frames = io.BytesIO()
    image.save(frames, format="GIF", save_all=True, append_images=[image.rotate(90)])
    return [
        encode(image, "PNG"),
        encode(image, "JPEG", quality=85),
        encode(image, "WEBP"),
        encode(image, "BMP"),
        frames.getvalue(),
        encode(image.convert("P", palette=Image.Palette.ADAPTIVE), "PNG", transparency=0),
        encode(image.convert("L").resize((300, 200)), "JPEG", progressive=True),
    ]


SEEDS = seed_images()


class InProcessClient:
    """The app over a running engine on an event loop thread, called synchronously (hypothesis tests are sync)."""

    def __init__(self, settings: Settings) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine, self.client = self.call(self.start(settings))

    async def start(self, settings: Settings) -> tuple[Engine, httpx.AsyncClient]:
        engine = await asyncio.to_thread(Engine.load, settings)  # started on the loop that serves it
        engine.start()
        return engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine)), base_url="http://test")

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def get(self, url: str, **kw: Any) -> httpx.Response:
        return self.call(self.client.get(url, **kw))

    def post(self, url: str, **kw: Any) -> httpx.Response:
        return self.call(self.client.post(url, **kw))

    def close(self) -> None:
        self.call(self.client.aclose())
        self.call(self.engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessClient]:
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "tiny.safetensors")
    c = InProcessClient(Settings(weights=checkpoint, device="cpu", max_wait_ms=0, max_image_pixels=4_000_000))
    try:
        yield c
        assert c.get("/health/ready").status_code == 200  # the service stays ready after all of it
    finally:
        c.close()


def check(r_status: int, body: dict[str, object] | None) -> None:
    assert r_status < 500, body
    if r_status != 200:
        assert body is not None and isinstance(body.get("detail"), str) and body["detail"]


@CASES
@given(data=st.binary(max_size=2048), content_type=st.sampled_from(CONTENT_TYPES), raw=st.booleans())
def test_random_bytes_never_fail_the_server(client: InProcessClient, data: bytes, content_type: str, raw: bool) -> None:
    if raw:
        r = client.post("/predict", content=data, headers={"content-type": content_type})
    else:
        r = client.post("/predict", files={"file": ("fuzz.bin", data, content_type)})
    check(r.status_code, r.json())


@CASES
@given(
    seed=st.sampled_from(SEEDS),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=12),
    keep=st.floats(0.05, 1.0),
    attention=st.sampled_from(["none", "rollout", "last"]),
)
def test_mutated_images_never_fail_the_server(
    client: InProcessClient, seed: bytes, flips: list[tuple[float, int]], keep: float, attention: str
) -> None:
    data = bytearray(seed[: max(1, int(len(seed) * keep))])  # possibly truncated
    for where, value in flips:
        data[int(where * len(data))] = value
    r = client.post("/predict", files={"file": ("m.img", bytes(data), "image/png")}, params={"attention": attention})
    check(r.status_code, r.json())
    if r.status_code == 200:
        assert sum(r.json()["results"][0]["probabilities"]) == pytest.approx(1.0, abs=1e-4)


@pytest.fixture(scope="module")
def zero_shot_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessClient]:
    from model.convert.__main__ import main as convert_main
    from tests.support.zero_shot import clip_repo

    folder = tmp_path_factory.mktemp("fuzz-clip")
    repo = clip_repo(folder)
    checkpoint = convert_main(["hf", "--model-dir", str(repo.path), "--output", str(folder / "clip.safetensors")])
    c = InProcessClient(Settings(weights=checkpoint, device="cpu", backend="torch", max_wait_ms=0))
    try:
        yield c
        assert c.get("/health/ready").status_code == 200
    finally:
        c.close()


LABEL_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=400)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    labels=st.one_of(st.none(), LABEL_TEXT),
    label=st.lists(LABEL_TEXT, max_size=4),
    template=st.one_of(st.none(), LABEL_TEXT, LABEL_TEXT.map(lambda t: t + "{}")),
    target=st.one_of(st.none(), LABEL_TEXT),
)
def test_any_labels_template_or_target_never_fail_a_zero_shot_model(
    zero_shot_client: InProcessClient, labels: str | None, label: list[str], template: str | None, target: str | None
) -> None:
    """Labels of any text (commas, braces, a thousand characters past the tokenizer's context), templates and
    targets: an answer, or a 4xx that says why."""
    params: dict[str, Any] = {"label": label}
    for name, value in (("labels", labels), ("template", template), ("target", target)):
        if value is not None:
            params[name] = value
    if target is not None:
        params["attention"] = "gradient"
    r = zero_shot_client.post("/predict", files={"file": ("s.png", SEEDS[0], "image/png")}, params=params)
    check(r.status_code, r.json())
    if r.status_code == 200:
        assert len(r.json()["results"][0]["probabilities"]) == len(
            labels.split(",") if labels is not None else []
        ) + len(label)
