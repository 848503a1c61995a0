"""The Open Inference Protocol's contract through the real clients, tritonclient over HTTP (binary and JSON
outputs) and gRPC, against a real server: every output the metadata lists comes back when it is requested by
name, alone or together, equal to what the parameter form gives; an output that cannot be given is the
protocol's client error, saying why."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from app.settings import BUNDLED_WEIGHTS
from harness.images import encode
from harness.server import Server
from model.shapes import make_sample
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
MODEL = "vit-shapes"  # the bundled model, with reference statistics: all four outputs
PLAIN = "tiny"  # without reference statistics: no ood_score
PNGS = [encode(make_sample(20261126, i).image) for i in range(3)]
# the parameters that ask for each output, as clients written before outputs by name ask for them
PARAMETER_FORM = {"attention": "rollout", "embedding": True, "ood": True}
# (transport, binary outputs over REST)
WAYS = [("http", True), ("http", False), ("grpc", False)]


@pytest.fixture(scope="module")
def server(serve: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tiny = write_tiny_checkpoint(tmp_path_factory.mktemp("outputs") / "tiny.safetensors")
    return serve(BUNDLED_WEIGHTS, VIT_MODELS=f"{MODEL}={BUNDLED_WEIGHTS},{PLAIN}={tiny}")


@pytest.fixture(scope="module")
def clients(server: Server) -> Iterator[dict[str, Any]]:
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = triton_grpc.InferenceServerClient(server.grpc_target)
    yield {"http": http, "grpc": grpc}
    http.close()
    grpc.close()


def infer(
    clients: dict[str, Any], way: tuple[str, bool], model: str, outputs: list[str] | None, **parameters: Any
) -> Any:
    transport, binary = way
    lib = triton_http if transport == "http" else triton_grpc
    image = lib.InferInput("image", [len(PNGS)], "BYTES")
    image.set_data_from_numpy(np.array(PNGS, dtype=np.object_))
    if outputs is None:
        wanted = None
    elif transport == "http":
        wanted = [triton_http.InferRequestedOutput(name, binary_data=binary) for name in outputs]
    else:
        wanted = [triton_grpc.InferRequestedOutput(name) for name in outputs]
    return clients[transport].infer(model, [image], outputs=wanted, parameters=parameters or None)


def listed(clients: dict[str, Any], way: tuple[str, bool], model: str) -> dict[str, tuple[str, list[int]]]:
    meta = clients[way[0]].get_model_metadata(model)
    if way[0] == "grpc":
        return {o.name: (o.datatype, list(o.shape)) for o in meta.outputs}
    return {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]}


@pytest.mark.parametrize("way", WAYS, ids=["http-binary", "http-json", "grpc"])
def test_every_listed_output_comes_back_alone_and_together_as_the_parameter_form_gives_it(
    clients: dict[str, Any], way: tuple[str, bool]
) -> None:
    outputs = listed(clients, way, MODEL)
    assert list(outputs) == ["probabilities", "attention", "embedding", "ood_score"]
    by_parameters = infer(clients, way, MODEL, None, **PARAMETER_FORM)
    expected = {name: by_parameters.as_numpy(name) for name in outputs}

    def check(result: Any, name: str) -> None:
        got = result.as_numpy(name)
        assert got is not None, f"{name} requested by name did not come back"
        datatype, shape = outputs[name]
        assert got.dtype == np.float32 and datatype == "FP32"
        assert list(got.shape) == [len(PNGS), *shape[1:]], (name, got.shape, shape)
        np.testing.assert_allclose(got, expected[name], rtol=1e-4, atol=1e-5, err_msg=name)

    for name in outputs:
        alone = infer(clients, way, MODEL, [name])
        check(alone, name)
        assert [n for n in outputs if alone.as_numpy(n) is not None] == [name]  # the requested ones alone
    together = infer(clients, way, MODEL, list(outputs))
    for name in outputs:
        check(together, name)


@pytest.mark.parametrize("way", WAYS[1:], ids=["http", "grpc"])
def test_parameters_still_choose_what_a_named_output_holds(clients: dict[str, Any], way: tuple[str, bool]) -> None:
    rollout = infer(clients, way, MODEL, ["attention"]).as_numpy("attention")
    last = infer(clients, way, MODEL, ["attention"], attention="last").as_numpy("attention")
    assert last.shape == rollout.shape and not np.allclose(last, rollout)
    top1 = infer(clients, way, MODEL, ["probabilities"]).as_numpy("probabilities").argmax(1)
    # a gradient map without a target explains each image's top-1 class, as documented for /predict and V2
    gradient = infer(clients, way, MODEL, ["attention"], attention="gradient").as_numpy("attention")
    for i, label in enumerate(top1):
        one = infer(clients, way, MODEL, ["attention"], attention="gradient", target=int(label))
        np.testing.assert_allclose(one.as_numpy("attention")[i], gradient[i], atol=1e-5)
    normalized = infer(clients, way, MODEL, ["embedding"], normalize=True).as_numpy("embedding")
    np.testing.assert_allclose(np.linalg.norm(normalized, axis=1), 1, atol=1e-5)


def refusal(call: Callable[[], object]) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return f"{caught.value.status()} {caught.value.message()}"


@pytest.mark.parametrize("way", WAYS[1:], ids=["http", "grpc"])
def test_an_output_that_cannot_be_given_is_the_protocols_client_error(
    clients: dict[str, Any], way: tuple[str, bool]
) -> None:
    client_error = "400" if way[0] == "http" else "StatusCode.INVALID_ARGUMENT"
    assert "ood_score" not in listed(clients, way, PLAIN)
    said = refusal(lambda: infer(clients, way, PLAIN, ["ood_score"]))
    assert said.startswith(client_error) and "has no reference statistics to score images by" in said, said
    said = refusal(lambda: infer(clients, way, MODEL, ["logits"]))
    assert said.startswith(client_error) and "unknown output 'logits'; this model gives 'probabilities'" in said
    said = refusal(lambda: infer(clients, way, MODEL, ["attention"], target="star"))
    assert said.startswith(client_error) and "target chooses the class a gradient map explains" in said, said
    said = refusal(lambda: infer(clients, way, MODEL, ["attention"], attention="gradient", target="nothing"))
    assert said.startswith(client_error) and "target 'nothing' names no class" in said, said
    assert clients[way[0]].is_server_ready()


def test_a_server_listing_probabilities_alone_refuses_the_others_by_name_and_by_parameter(
    serve: ServerFactory,
) -> None:
    plain = serve(BUNDLED_WEIGHTS, VIT_V2_OUTPUTS="probabilities")
    clients = {
        "http": triton_http.InferenceServerClient(plain.url.removeprefix("http://")),
        "grpc": triton_grpc.InferenceServerClient(plain.grpc_target),
    }
    try:
        for way in WAYS[1:]:
            client_error = "400" if way[0] == "http" else "StatusCode.INVALID_ARGUMENT"
            assert list(listed(clients, way, MODEL)) == ["probabilities"]
            assert infer(clients, way, MODEL, ["probabilities"]).as_numpy("probabilities").shape == (len(PNGS), 10)
            said = refusal(lambda way=way: infer(clients, way, MODEL, ["embedding"]))  # type: ignore[misc]
            assert said.startswith(client_error) and "(VIT_V2_OUTPUTS=probabilities)" in said, said
            said = refusal(lambda way=way: infer(clients, way, MODEL, None, attention="rollout"))  # type: ignore[misc]
            assert said.startswith(client_error) and "asks for an output this server does not give" in said, said
    finally:
        for c in clients.values():
            c.close()
