"""Drift gauges: the window's arithmetic, and the gauges through the service as traffic moves from the model's own
kind of images to noise and back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.core.engine.drift import DriftWatch, DriftWindow
from app.settings import BUNDLED_WEIGHTS
from harness.images import encode
from tests.support.clients import ClientFactory, client_factory
from tests.support.metrics import drift_gauges as drift


def test_the_window_keeps_the_last_images_and_measures_them() -> None:
    window = DriftWindow(4, torch.tensor([0.5, 0.5, 0.0]))
    assert window.prediction_drift() == 0.0 and window.embedding_drift() == 0.0  # empty
    window.add([0, 1], [1.0, 3.0])
    assert window.prediction_drift() == 0.0 and window.embedding_drift() == 2.0  # the prior's own mix
    window.add([2, 2, 2], [10.0, 10.0, 10.0])  # the first image leaves: classes 1, 2, 2, 2
    assert len(window) == 4 and window.embedding_drift() == pytest.approx(33 / 4)
    assert window.prediction_drift() == pytest.approx(0.5 * (0.5 + 0.25 + 0.75))
    for _ in range(10):  # the running sum, refreshed now and then, stays the window's
        window.add([1], [float(np.pi)])
    assert window.embedding_drift() == pytest.approx(np.pi) and window.prediction_drift() == pytest.approx(0.5)


@pytest.fixture
def make_bundled() -> ClientFactory:
    return client_factory(Path(BUNDLED_WEIGHTS))  # with reference statistics of 5,000 shapes


async def test_the_gauges_rise_when_traffic_shifts_and_fall_when_it_returns(make_bundled: ClientFactory) -> None:
    from model.shapes import make_sample

    # held-out shapes, then others of the same class mix: at a window of 32 a mix of its own moves the prediction
    # gauge as much as a shift of traffic does, and only the kind of traffic is to move it here. Noise moves the
    # embedding gauge; the prediction gauge is moved by a shift in the classes predicted (here all stars), which
    # noise need not be: a model trained towards equal probabilities for it spreads its top-1 over the classes
    before_set = [make_sample(20261121, i) for i in range(32)]
    wanted, after_set = [s.label for s in before_set], []
    for i in range(32, 2000):
        sample = make_sample(20261121, i)
        if sample.label in wanted:
            wanted.remove(sample.label)
            after_set.append(sample)
    assert not wanted
    noise = [
        encode(Image.fromarray(np.random.default_rng(i).integers(0, 256, (64, 64, 3), np.uint8))) for i in range(32)
    ]
    stars = [s for s in (make_sample(20261121, i) for i in range(2000, 3000)) if s.label == 5][:32]

    async def send(files: list[bytes]) -> dict[str, float]:
        for k in range(0, len(files), 16):
            upload = [("files", (f"{i}.png", f, "image/png")) for i, f in enumerate(files[k : k + 16])]
            r = await client.post("/predict", files=upload)
            assert r.status_code == 200
            assert "ood_score" not in r.json()["results"][0]  # scored for the gauges, not for the client
        return drift((await client.get("/metrics")).text, "vit-shapes")

    async with make_bundled(drift_window=32, max_files=16) as client:
        assert drift((await client.get("/metrics")).text, "vit-shapes") == {}  # they appear with the first batch
        before = await send([encode(s.image) for s in before_set])
        noisy = await send(noise)  # what the model never saw: the embeddings move
        one_class = await send([encode(s.image) for s in stars])  # shapes it knows, all of one class: the mix moves
        after = await send([encode(s.image) for s in after_set])
    assert noisy["embedding"] > 2 * before["embedding"] and noisy["embedding"] > 2 * after["embedding"]
    assert one_class["embedding"] < noisy["embedding"] / 2
    assert one_class["prediction"] > before["prediction"] + 0.2 and after["prediction"] < one_class["prediction"] - 0.2


async def test_no_gauges_without_reference_statistics_or_with_the_window_off(
    make_client: ClientFactory, make_bundled: ClientFactory
) -> None:
    png = encode(Image.new("RGB", (32, 32)))
    async with make_client() as client:  # a checkpoint without statistics
        await client.post("/predict", files={"file": ("a.png", png, "image/png")})
        assert drift((await client.get("/metrics")).text, "tiny") == {}
    async with make_bundled(drift_window=0) as client:
        await client.post("/predict", files={"file": ("a.png", png, "image/png")})
        assert drift((await client.get("/metrics")).text, "vit-shapes") == {}


async def test_a_window_that_fails_never_keeps_a_batch_from_its_requests(
    make_bundled: ClientFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The window is fed from the batcher's observer, before the batch's requests are answered: a failure there
    is logged, and the requests are answered all the same."""

    def broken(self: DriftWatch, outputs: object) -> None:
        raise RuntimeError("a window that cannot take this batch")

    monkeypatch.setattr(DriftWatch, "add", broken)
    png = encode(Image.new("RGB", (32, 32)))
    async with make_bundled() as client:
        r = await client.post("/predict", files={"file": ("a.png", png, "image/png")})
    assert r.status_code == 200 and r.json()["results"][0]["top_k"]
    assert "could not be added to the window" in caplog.text
