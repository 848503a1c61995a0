"""Models loaded, replaced and removed while serving, through the core alone: nothing admitted is lost."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from app.core.contract.errors import InvalidInput, LoadFailed, ModelNotFound, NotAllowed
from app.core.contract.request import EncodedImage, InferOptions
from app.core.engine.engine import Engine
from app.telemetry.metrics import Metrics
from harness.images import encode
from model.shapes import make_sample
from tests.support.checkpoints import replace_checkpoint, write_tiny_checkpoint
from tests.support.clients import slow_forward, until
from tests.support.settings import cpu_settings

IMAGE = [EncodedImage("a.png", encode(make_sample(3, 0).image))]


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """Models a (seed 0) and b (seed 1), and a file that is no model."""
    write_tiny_checkpoint(tmp_path / "a.safetensors", seed=0)
    write_tiny_checkpoint(tmp_path / "b.safetensors", seed=1)
    (tmp_path / "notes.txt").write_text("not a model")
    return tmp_path


ServiceFactory = Callable[..., Any]


@pytest.fixture
def make_service(repository: Path) -> ServiceFactory:
    @asynccontextmanager
    async def make(**overrides: Any) -> AsyncIterator[Engine]:
        settings = cpu_settings(
            **{"model_repository": repository, "model_control": "explicit", "max_batch_size": 4, **overrides}
        )
        async with Engine.serving(settings) as service:
            yield service

    return make


def index(service: Engine) -> dict[str, tuple[str, str, str]]:
    return {s.name: (s.state, s.version, s.reason) for s in service.model_set.index()}


async def test_explicit_mode_loads_what_it_is_told(make_service: ServiceFactory) -> None:
    async with make_service(models="a") as service:
        assert list(service.served) == ["a"]
        assert index(service)["b"] == ("UNAVAILABLE", "", "not loaded") and "notes" not in index(service)
        b = await service.model_set.load("b")
        assert list(service.served) == ["a", "b"] and service.default is service.served["a"]
        assert index(service)["b"] == ("READY", b.version, "")
        done = await service.lane.run(service.model("b"), IMAGE, InferOptions())
        assert done.model is b.description and len(done.predictions) == 1
        assert service.metrics.models_loaded._value.get() == 2


async def test_explicit_mode_may_start_with_no_model(make_service: ServiceFactory) -> None:
    async with make_service() as service:
        service.check_serving()  # every model that should be loaded (none) is
        with pytest.raises(ModelNotFound, match="no model is loaded"):
            service.model(None)
        await service.model_set.load("a")
        assert service.model(None).name == "a"


async def test_a_reload_finishes_admitted_requests_on_the_old_version(
    make_service: ServiceFactory, repository: Path
) -> None:
    async with make_service(models="a") as service:
        old = service.model("a")
        slow_forward(old, 0.5)
        in_flight = asyncio.create_task(service.lane.run(old, IMAGE, InferOptions()))
        await until(lambda: old.batcher.queue_depth == 0 and not old.batcher._idle.is_set())  # admitted, computing
        new_version = replace_checkpoint(repository / "a.safetensors", seed=7)
        new = await service.model_set.load("a")
        assert (await in_flight).model is old.description  # answered by the version that admitted it
        assert new.version == new_version != old.version and service.model("a") is new
        assert old.retired and old.batcher.queue_depth == 0
        # An edge that looked the model up before the switch gets the new version.
        assert (await service.lane.run(old, IMAGE, InferOptions())).model is new.description


async def test_an_unload_answers_what_it_admitted_then_refuses(make_service: ServiceFactory) -> None:
    async with make_service(models="a,b") as service:
        a = service.model("a")
        slow_forward(a, 0.5)
        in_flight = asyncio.create_task(service.lane.run(a, IMAGE, InferOptions()))
        await until(lambda: not a.batcher._idle.is_set())
        await service.model_set.unload("a")
        assert (await in_flight).model is a.description
        with pytest.raises(ModelNotFound, match="'a' was unloaded; this service serves: b"):
            await service.lane.run(a, IMAGE, InferOptions())
        with pytest.raises(ModelNotFound, match="no model named 'a'"):
            service.model("a")
        assert index(service)["a"] == ("UNAVAILABLE", a.version, "unloaded")
        assert service.default is service.served["b"]
        await service.model_set.unload("a")  # known and not loaded: nothing to do
        with pytest.raises(ModelNotFound):
            await service.model_set.unload("never-there")


async def test_a_file_that_fails_to_load_leaves_the_old_version_serving(
    make_service: ServiceFactory, repository: Path
) -> None:
    async with make_service(models="a") as service:
        old = service.model("a")
        (repository / "a.safetensors").write_bytes(b"not a checkpoint")
        with pytest.raises(
            LoadFailed, match=f"failed to load a.safetensors: .*; version {old.version} goes on serving"
        ):
            await service.model_set.load("a")
        assert service.model("a") is old and not old.retired
        state, version, reason = index(service)["a"]
        assert (state, version) == ("UNAVAILABLE", old.version) and "goes on serving" in reason
        assert service.metrics.model_load_failures.labels("a")._value.get() == 1
        service.check_serving()
        assert len((await service.lane.run(service.model("a"), IMAGE, InferOptions())).predictions) == 1


@pytest.mark.parametrize("name", ["../a", "a/b", ".hidden", "a..b", "", "x" * 65, "/etc/passwd"])
async def test_only_names_never_paths(make_service: ServiceFactory, name: str) -> None:
    async with make_service() as service:
        with pytest.raises(InvalidInput, match="is not a model name"):
            await service.model_set.load(name)
        with pytest.raises(InvalidInput, match="is not a model name"):
            await service.model_set.unload(name)


async def test_nothing_outside_the_repository_is_read(
    make_service: ServiceFactory, repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = write_tiny_checkpoint(tmp_path_factory.mktemp("outside") / "secret.safetensors")
    os.symlink(outside, repository / "secret.safetensors")
    async with make_service() as service:
        assert "secret" not in index(service)
        with pytest.raises(ModelNotFound, match="no model named 'secret' in the model repository"):
            await service.model_set.load("secret")
        with pytest.raises(ModelNotFound, match="no model named 'missing'"):
            await service.model_set.load("missing")


@pytest.mark.parametrize("control", ["none", "poll"])
async def test_the_api_changes_models_in_explicit_mode_only(make_service: ServiceFactory, control: str) -> None:
    async with make_service(model_control=control) as service:
        assert list(service.served) == ["a", "b"]  # none and poll load every model file
        with pytest.raises(NotAllowed, match=f"VIT_MODEL_CONTROL={control}"):
            await service.model_set.load("a")
        with pytest.raises(NotAllowed, match=f"VIT_MODEL_CONTROL={control}"):
            await service.model_set.unload("a")


async def test_poll_mode_follows_the_files(make_service: ServiceFactory, repository: Path) -> None:
    async with make_service(model_control="poll", models="b", repository_poll_s=0.05) as service:
        assert list(service.served) == ["b", "a"]  # VIT_MODELS first: b is the default
        write_tiny_checkpoint(repository / "c.safetensors", seed=2)
        await until(lambda: "c" in service.served, timeout=30)
        old_a = service.model("a")
        new_version = replace_checkpoint(repository / "a.safetensors", seed=9)
        await until(lambda: service.served["a"].version == new_version, timeout=30)
        assert old_a.retired and list(service.served)[:2] == ["b", "a"]
        (repository / "b.safetensors").unlink()
        await until(lambda: index(service)["b"][0] == "UNAVAILABLE", timeout=30)
        assert "b" not in service.served and service.default is service.served["a"]
        (repository / "c.safetensors").write_bytes(b"broken")  # a bad file: c keeps serving
        await until(lambda: index(service)["c"][0] == "UNAVAILABLE", timeout=30)
        assert "c" in service.served and "goes on serving" in index(service)["c"][2]


def test_startup_checks_the_repository(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    with pytest.raises(ValueError, match="VIT_MODELS names zzz, but VIT_MODEL_REPOSITORY .* it has: a, b"):
        Engine.load(cpu_settings(model_repository=repository, models="zzz"), Metrics())
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(ValueError, match="holds no model file"):
        Engine.load(cpu_settings(model_repository=empty), Metrics())
    assert Engine.load(cpu_settings(model_repository=empty, model_control="poll"), Metrics()).served == {}


async def test_a_change_under_way_finishes_when_its_caller_is_cancelled(make_service: ServiceFactory) -> None:
    async with make_service(models="a") as service:
        a = service.model("a")
        slow_forward(a, 0.5)
        in_flight = asyncio.create_task(service.lane.run(a, IMAGE, InferOptions()))
        await until(lambda: not a.batcher._idle.is_set())
        unloading = asyncio.create_task(service.model_set.unload("a"))
        await until(lambda: index(service)["a"][0] == "UNLOADING")
        unloading.cancel()  # e.g. the gRPC client went away
        assert (await in_flight).model is a.description
        await until(lambda: index(service)["a"][0] == "UNAVAILABLE")
        assert a.batcher._task is not None and a.batcher._task.done()  # stopped, not left running
