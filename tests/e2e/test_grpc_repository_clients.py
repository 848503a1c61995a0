"""Triton's model repository extension from tritonclient, unchanged, over gRPC and REST against a real server."""

from __future__ import annotations

import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from harness.server import Server
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
KEY = {"x-api-key": "k"}


@pytest.fixture(scope="module")
def server(serve: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> Server:
    folder = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(["a", "b", "c"]):
        write_tiny_checkpoint(folder / f"{name}.safetensors", seed)
    return serve(
        folder / "a.safetensors",
        VIT_MODEL_REPOSITORY=str(folder),
        VIT_MODEL_CONTROL="explicit",
        VIT_MODELS="a",
        VIT_API_KEYS="k",
        VIT_WARMUP="false",
    )


def states(index: list[dict[str, str]]) -> dict[str, str]:
    return {m["name"]: m.get("state", "") for m in index}


def test_over_grpc(server: Server) -> None:
    client = triton_grpc.InferenceServerClient(server.grpc_target)
    try:
        assert states(client.get_model_repository_index(as_json=True)["models"]) == {
            "a": "READY",
            "b": "UNAVAILABLE",
            "c": "UNAVAILABLE",
        }
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            client.load_model("b")
        client.load_model("b", headers=KEY)
        assert client.is_model_ready("b")
        assert client.get_model_metadata("b", as_json=True)["name"] == "b"
        client.unload_model("b", headers=KEY)
        assert not client.is_model_ready("b")
        with pytest.raises(InferenceServerException, match=r"INVALID_ARGUMENT.*is not a model name"):
            client.load_model("../a", headers=KEY)
        with pytest.raises(InferenceServerException, match="NOT_FOUND"):
            client.load_model("zzz", headers=KEY)
    finally:
        client.close()


def test_over_rest(server: Server) -> None:
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        client.load_model("c", headers=KEY)
        assert client.is_model_ready("c")
        ready = client.get_model_repository_index()
        assert states(ready)["c"] == "READY"
        client.unload_model("c", headers=KEY)
        assert not client.is_model_ready("c") and states(client.get_model_repository_index())["c"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException, match=r"\[401\]"):
            client.unload_model("a")
        assert client.is_model_ready("a") and client.is_server_ready()
    finally:
        client.close()
