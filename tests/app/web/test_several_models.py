"""Several models in one process: VIT_MODELS, /predict?model=, /v1/models, labelled metrics, readiness."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings
from model.checkpoint import save_checkpoint
from tests.support.checkpoints import TINY, TINY_PREPROCESSING, tiny_model
from tests.support.clients import ClientFactory


@pytest.fixture
def second_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "second.safetensors"
    save_checkpoint(path, tiny_model(TINY, seed=1), [f"thing{i}" for i in range(10)], TINY_PREPROCESSING)
    return path


async def test_two_models_serve_side_by_side(
    make_client: ClientFactory, tiny_checkpoint: Path, second_checkpoint: Path, shape_png: bytes
) -> None:
    models = f"first={tiny_checkpoint},other={second_checkpoint}"
    async with make_client(models=models) as client:
        listed = (await client.get("/v1/models")).json()
        assert listed["default"] == "first"
        assert [m["name"] for m in listed["models"]] == ["first", "other"]
        assert (await client.get("/v1/model")).json()["name"] == "first"
        files = {"file": ("a.png", shape_png, "image/png")}
        default = (await client.post("/predict", files=files)).json()
        other = (await client.post("/predict", files=files, params={"model": "other"})).json()
        assert default["model"]["name"] == "first" and other["model"]["name"] == "other"
        assert other["results"][0]["top_k"][0]["label"].startswith("thing")
        assert default["results"][0]["probabilities"] != other["results"][0]["probabilities"]
        missing = await client.post("/predict", files=files, params={"model": "nope"})
        assert missing.status_code == 404
        assert missing.json()["detail"] == "no model named 'nope'; this service serves: first, other"
        text = (await client.get("/metrics")).text
        assert 'vit_images_processed_total{model="first"} 1.0' in text
        assert 'vit_images_processed_total{model="other"} 1.0' in text
        assert 'vit_queue_depth{model="other"} 0.0' in text
        assert (await client.get("/health/ready")).status_code == 200


def test_vit_weights_names_its_model_by_the_file_stem(tiny_checkpoint: Path) -> None:
    assert Settings(weights=tiny_checkpoint).model_paths() == {"tiny": tiny_checkpoint}
    assert Settings(weights=tiny_checkpoint, models="").model_paths() == {"tiny": tiny_checkpoint}  # compose's empty
    both = Settings(weights=tiny_checkpoint, models="a=/x.safetensors")  # the container always sets VIT_WEIGHTS
    assert both.model_paths() == {"a": Path("/x.safetensors")}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"models": "a=/x.safetensors,b"}, "VIT_MODELS entry 'b' is not name=path"),
        ({"models": "a=/x.safetensors,a=/y.safetensors"}, "VIT_MODELS names 'a' twice"),
        ({"models": "bad name=/x.safetensors"}, "is not name=path"),
    ],
)
def test_bad_model_lists_are_refused_with_what_to_fix(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**env)  # type: ignore[arg-type]


async def test_a_bad_checkpoint_among_several_fails_startup(
    make_client: ClientFactory, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a checkpoint")
    with pytest.raises(Exception, match="broken.safetensors"):
        async with make_client(models=f"a={tiny_checkpoint},b={broken}"):
            pass
