"""The model repository extension over REST (Triton's routes), in process: index, load, unload, and what
/v1/models, /v2/models and readiness show meanwhile."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checkpoints import replace_checkpoint, write_broken_checkpoints, write_tiny_checkpoint
from tests.support.clients import ClientFactory


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_checkpoint(folder / "a.safetensors", seed=0)
    write_tiny_checkpoint(folder / "b.safetensors", seed=1)
    return folder


async def test_index_load_and_unload(make_client: ClientFactory, repository: Path, shape_png: bytes) -> None:
    async with make_client(model_repository=repository, model_control="explicit", models="a") as client:
        r = await client.post("/v2/repository/index")
        assert r.status_code == 200, r.text
        a_version = r.json()[0]["version"]
        assert r.json() == [
            {"name": "a", "version": a_version, "state": "READY", "reason": ""},
            {"name": "b", "version": "", "state": "UNAVAILABLE", "reason": "not loaded"},
        ]
        assert [m["name"] for m in (await client.post("/v2/repository/index", json={"ready": True})).json()] == ["a"]
        assert (await client.get("/v2/models/b")).status_code == 404

        r = await client.post("/v2/repository/models/b/load")
        assert r.status_code == 200, r.text
        assert (await client.get("/v2/models/b/ready")).json() == {"name": "b", "ready": True}
        listing = (await client.get("/v1/models")).json()
        assert listing["default"] == "a" and [m["name"] for m in listing["models"]] == ["a", "b"]
        r = await client.post("/predict?model=b", files={"file": ("s.png", shape_png, "image/png")})
        assert r.status_code == 200, r.text

        new_version = replace_checkpoint(repository / "a.safetensors", seed=5)
        assert (await client.post("/v2/repository/models/a/load", json={})).status_code == 200  # a reload
        r = await client.post("/predict", files={"file": ("s.png", shape_png, "image/png")})
        assert r.json()["model"] == {"name": "a", "version": new_version}

        r = await client.post("/v2/repository/models/a/unload", json={"parameters": {"unload_dependents": False}})
        assert r.status_code == 200, r.text
        assert (await client.get("/v2/models/a")).status_code == 404
        assert (await client.get("/v1/models")).json()["default"] == "b"
        assert (await client.get("/health/ready")).status_code == 200
        index = {m["name"]: m for m in (await client.post("/v2/repository/index")).json()}
        assert index["a"] == {"name": "a", "version": new_version, "state": "UNAVAILABLE", "reason": "unloaded"}
        assert "vit_models_loaded 1.0" in (await client.get("/metrics")).text


async def test_errors(make_client: ClientFactory, repository: Path) -> None:
    async with make_client(model_repository=repository, model_control="explicit") as client:
        assert (await client.get("/v1/models")).json() == {"default": None, "models": []}
        r = await client.get("/v1/model")
        assert r.status_code == 404 and "no model is loaded" in r.json()["detail"]
        for name, status, message in [
            ("a..b", 400, "is not a model name"),
            (".env", 400, "is not a model name"),
            ("missing", 404, "no model named 'missing' in the model repository"),
        ]:
            r = await client.post(f"/v2/repository/models/{name}/load")
            assert (r.status_code, message in r.json()["error"]) == (status, True), r.text
            assert "/" not in r.json()["error"], r.text  # names the model, never the server's path
        r = await client.post("/v2/repository/models/%2E%2E%2Fsecret/load")
        assert r.status_code in (400, 404), r.text  # an encoded path never becomes one
        r = await client.post("/v2/repository/models/a/load", json={"parameters": {"config": "{}"}})
        assert r.status_code == 400 and "load parameter 'config' is not taken" in r.json()["error"]
        r = await client.post("/v2/repository/models/a/load", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"].startswith("invalid request body: Invalid JSON"), r.text
        (repository / "b.safetensors").write_bytes(b"broken")
        r = await client.post("/v2/repository/models/b/load")
        assert r.status_code == 400 and "failed to load b.safetensors" in r.json()["error"]
        assert (await client.get("/health/ready")).status_code == 200
        assert 'vit_model_load_failures_total{model="b"} 1.0' in (await client.get("/metrics")).text


async def test_none_mode_refuses_changes(make_client: ClientFactory) -> None:
    async with make_client() as client:
        r = await client.post("/v2/repository/models/tiny/unload")
        assert r.status_code == 400 and "VIT_MODEL_CONTROL=none" in r.json()["error"]
        index = (await client.post("/v2/repository/index")).json()
        assert [(m["name"], m["state"]) for m in index] == [("tiny", "READY")]


async def test_changes_need_an_api_key(make_client: ClientFactory, repository: Path) -> None:
    async with make_client(model_repository=repository, model_control="explicit", api_keys="k") as client:
        assert (await client.post("/v2/repository/models/a/load")).status_code == 401
        assert (await client.post("/v2/repository/models/a/unload")).status_code == 401
        assert (await client.post("/v2/repository/index")).status_code == 200
        assert (await client.get("/v2/models/stats")).status_code == 200  # like the index: no key
        assert (await client.post("/v2/repository/models/a/load", headers={"x-api-key": "k"})).status_code == 200


async def test_a_file_that_fails_to_load_is_named_never_placed(
    make_client: ClientFactory, repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every way a file fails to load (corrupt, not a checkpoint, a refused architecture, out of memory, gone) is
    answered with the model's file name and what is wrong with it; where it lies on the server goes to the log."""
    broken = write_broken_checkpoints(repository)
    async with make_client(model_repository=repository, model_control="explicit", api_keys="k") as client:
        for name, what in broken.items():
            r = await client.post(f"/v2/repository/models/{name}/load", headers={"x-api-key": "k"})
            error = r.json()["error"]
            assert r.status_code == 400 and error.startswith(f"failed to load {name}.safetensors: "), error
            assert what in error and "/" not in error, error
            assert str(repository / f"{name}.safetensors") in caplog.text  # the server's log has the path
        (repository / "corrupt.safetensors").unlink()  # gone since the index listed it
        r = await client.post("/v2/repository/models/corrupt/load", headers={"x-api-key": "k"})
        assert r.status_code == 404 and r.json()["error"] == "no model named 'corrupt' in the model repository"
        index = {m["name"]: m for m in (await client.post("/v2/repository/index")).json()}  # no key needed
    for name, what in broken.items():
        assert index[name]["state"] == "UNAVAILABLE" and what in index[name]["reason"], index[name]
        assert "/" not in index[name]["reason"], index[name]
