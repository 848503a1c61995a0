"""Shadow challengers through the service: the comparison on the same images, the fraction, shedding under load
(the champion answering every request meanwhile), and the settings refused at startup."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from app.core.engine.engine import Engine
from app.settings import BUNDLED_WEIGHTS
from harness.images import encode
from model.shapes import make_sample
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.clients import client_factory, slow_forward
from tests.support.metrics import drift_gauges
from tests.support.settings import cpu_settings

SHAPES = [encode(make_sample(20261121, i).image) for i in range(8)]


def upload(files: list[bytes]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("files", (f"{i}.png", f, "image/png")) for i, f in enumerate(files)]


async def report_when(client: httpx.AsyncClient, champion: str, done: int) -> dict[str, object]:
    """The shadow report once `done` images are compared or shed (shadow work runs after the answers)."""
    for _ in range(400):
        body = (await client.get(f"/v1/models/{champion}/shadow")).json()
        if body["compared"] + body["shed"] >= done:
            return body  # type: ignore[no-any-return]
        await asyncio.sleep(0.025)
    raise AssertionError(f"the shadow did not get through {done} images: {body}")


async def test_a_model_against_itself_agrees_entirely(tmp_path: Path) -> None:
    models = f"a={BUNDLED_WEIGHTS},b={BUNDLED_WEIGHTS}"
    async with client_factory(BUNDLED_WEIGHTS)(models=models, shadow="a:b", max_files=8) as client:
        r = await client.post("/predict", files=upload(SHAPES), params={"model": "a"})
        assert r.status_code == 200
        body = await report_when(client, "a", 8)
        metrics = (await client.get("/metrics")).text
    assert body["champion"] == "a" and body["challenger"] == "b" and body["fraction"] == 1.0
    assert body["compared"] == 8 and body["shed"] == 0
    assert body["top1_agreement"] == 1.0 and body["mean_tv_distance"] == 0.0
    assert body["champion_p50_ms"] > 0 and body["challenger_p50_ms"] > 0
    assert 'vit_shadow_compared_total{challenger="b",champion="a"} 8.0' in metrics
    assert 'vit_shadow_top1_agreements_total{challenger="b",champion="a"} 8.0' in metrics


async def test_another_model_is_compared_on_the_champions_images_at_its_fraction(tmp_path: Path) -> None:
    other = write_tiny_checkpoint(tmp_path / "other.safetensors", seed=3)  # the same classes, other weights
    models = f"champion={BUNDLED_WEIGHTS},challenger={other}"
    async with client_factory(BUNDLED_WEIGHTS)(models=models, shadow="champion:challenger:0.5", max_files=8) as client:
        champion = (await client.post("/predict", files=upload(SHAPES))).json()["results"]
        body = await report_when(client, "champion", 4)
        direct = (await client.post("/predict", files=upload(SHAPES[1::2]), params={"model": "challenger"})).json()
    assert body["compared"] == 4 and body["shed"] == 0  # every second image: 1, 3, 5, 7
    mine = torch.tensor([champion[i]["probabilities"] for i in (1, 3, 5, 7)])
    theirs = torch.tensor([x["probabilities"] for x in direct["results"]])
    agreement = float((mine.argmax(1) == theirs.argmax(1)).float().mean())
    assert body["top1_agreement"] == pytest.approx(agreement)
    assert body["mean_tv_distance"] == pytest.approx(float(0.5 * (mine - theirs).abs().sum(1).mean()), abs=1e-5)
    assert body["mean_tv_distance"] > 0.1  # a random model against a trained one


async def test_shadow_work_is_shed_under_load_and_the_champion_answers_every_request(tmp_path: Path) -> None:
    models = f"a={BUNDLED_WEIGHTS},b={BUNDLED_WEIGHTS}"
    settings = {"models": models, "shadow": "a:b", "max_files": 8, "max_batch_size": 4, "max_wait_ms": 0}
    async with client_factory(BUNDLED_WEIGHTS)(**settings) as client:
        served = client.app.state.data_plane.served  # type: ignore[attr-defined]
        slow_forward(served["a"], 0.05)  # the champion falls behind: its queue fills
        answers = await asyncio.gather(
            *(client.post("/predict", files=upload(SHAPES), params={"model": "a"}) for _ in range(8))
        )
        body = await report_when(client, "a", 64)
    assert all(r.status_code == 200 for r in answers)
    assert body["shed"] > 0 and body["compared"] + body["shed"] == 64


async def test_fraction_zero_computes_nothing_and_a_model_without_a_challenger_is_not_found() -> None:
    models = f"a={BUNDLED_WEIGHTS},b={BUNDLED_WEIGHTS}"
    async with client_factory(BUNDLED_WEIGHTS)(models=models, shadow="a:b:0", max_files=8) as client:
        assert (await client.post("/predict", files=upload(SHAPES))).status_code == 200
        assert client.app.state.data_plane.shadowing.pumps == {}  # type: ignore[attr-defined]  # nothing handed over
        body = (await client.get("/v1/models/a/shadow")).json()
        missing = await client.get("/v1/models/b/shadow")
        unknown = await client.get("/v1/models/nope/shadow")
    assert (body["compared"], body["shed"], body["top1_agreement"]) == (0, 0, None)
    assert missing.status_code == 404 and "no shadow challenger" in missing.json()["detail"]
    assert unknown.status_code == 404 and unknown.json()["detail"] == "no model named 'nope'; this service serves: a, b"


@pytest.mark.parametrize(
    ("shadow", "message"),
    [
        ("a:nope", "no model 'nope' is served"),
        ("a:tiny", "the models' classes differ"),
    ],
)
async def test_a_pair_that_cannot_be_compared_fails_the_start(tmp_path: Path, shadow: str, message: str) -> None:
    from model.checkpoint import load_checkpoint, save_checkpoint

    tiny = write_tiny_checkpoint(tmp_path / "t.safetensors")
    other = load_checkpoint(tiny)
    relabelled = tmp_path / "relabelled.safetensors"
    save_checkpoint(relabelled, other.model, [f"c{i}" for i in range(10)], other.preprocessing)
    settings = cpu_settings(models=f"a={BUNDLED_WEIGHTS},tiny={relabelled}", shadow=shadow)
    with pytest.raises(ValueError, match=message):
        async with Engine.serving(settings):
            pass


@pytest.mark.parametrize(
    ("value", "message"),
    [("a", "not champion:challenger"), ("a:b:2", "from 0 to 1"), ("a:a", "cannot shadow itself"), ("a:b,a:c", "more")],
)
def test_malformed_pairs_are_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_settings(shadow=value)


async def test_a_threshold_for_a_model_not_served_fails_the_start() -> None:
    settings = cpu_settings(models=f"vit-shapes={BUNDLED_WEIGHTS}", ood_threshold="vit-shape=30")
    with pytest.raises(
        ValueError, match="VIT_OOD_THRESHOLD vit-shape=30: no model 'vit-shape' is served; served: vit-shapes"
    ):
        async with Engine.serving(settings):
            pass
    async with Engine.serving(cpu_settings(models=f"vit-shapes={BUNDLED_WEIGHTS}", ood_threshold="0.5")):
        pass  # a threshold for every model names none


@pytest.mark.parametrize("threshold", ["30", "vit-shapes=1"])
async def test_a_distances_threshold_on_a_zero_to_one_score_fails_the_start(threshold: str) -> None:
    """The bundled model scores by 1 - its top probability: a threshold of 1 or more, as a Mahalanobis distance's
    would be, could flag nothing, and says so instead."""
    settings = cpu_settings(models=f"vit-shapes={BUNDLED_WEIGHTS}", ood_threshold=threshold)
    with pytest.raises(ValueError, match="score is max_softmax, 1 - its top probability, always under 1"):
        async with Engine.serving(settings):
            pass


async def test_the_challengers_drift_gauges_count_the_champions_images_it_computed() -> None:
    """Only the champion is asked; the challenger's window fills with the shadow images it computed, so its
    gauges match the champion's over the same traffic (the same weights here)."""
    models = f"a={BUNDLED_WEIGHTS},b={BUNDLED_WEIGHTS}"
    async with client_factory(BUNDLED_WEIGHTS)(models=models, shadow="a:b", max_files=8, drift_window=16) as client:
        assert (await client.post("/predict", params={"model": "a"}, files=upload(SHAPES))).status_code == 200
        assert (await report_when(client, "a", 8))["compared"] == 8
        text = (await client.get("/metrics")).text
    champion, challenger = drift_gauges(text, "a"), drift_gauges(text, "b")
    assert set(challenger) == {"prediction", "embedding"} and challenger["embedding"] > 0
    assert challenger == pytest.approx(champion, rel=1e-4)
