"""System shared memory, as tritonclient's own utilities use it (`tritonclient.utils.shared_memory`), over HTTP and
gRPC, against a real server with two front-end processes: regions registered through one client serve the
requests of others; inputs of each type are read from regions and outputs of each kind written to them; hostile
use gets the protocol's error and nothing else."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from app.settings import BUNDLED_WEIGHTS
from harness.server import Server
from model.shapes import make_sample
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
MODEL = "vit-shapes"
LIMIT = 6


@pytest.fixture(scope="module")
def server(serve: ServerFactory) -> Server:
    return serve(
        BUNDLED_WEIGHTS, VIT_MODELS=f"{MODEL}={BUNDLED_WEIGHTS}", VIT_WORKERS="2", VIT_SHARED_MEMORY_REGIONS=str(LIMIT)
    )


def client(server: Server, protocol: str) -> Any:
    """A new client, a new connection: with two front-ends, the kernel may hand it to either."""
    if protocol == "http":
        return httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    return grpcclient.InferenceServerClient(server.grpc_target)


def module(protocol: str) -> Any:
    return httpclient if protocol == "http" else grpcclient


@pytest.fixture
def regions(server: Server) -> Iterator[list[Any]]:
    """Shared-memory objects made by tritonclient's utilities; destroyed, and every region unregistered, after."""
    made: list[Any] = []
    yield made
    httpclient.InferenceServerClient(server.url.removeprefix("http://")).unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def make_region(made: list[Any], size: int) -> tuple[Any, str]:
    key = f"/vit-test-{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(key.lstrip("/"), key, size)
    made.append(handle)
    return handle, key


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    make_sample(seed, seed % 10).image.save(buf, format="PNG")
    return buf.getvalue()


def output(protocol: str, name: str, **kwargs: Any) -> Any:
    if protocol == "http":
        return httpclient.InferRequestedOutput(name, binary_data=True, **kwargs)
    return grpcclient.InferRequestedOutput(name, **kwargs)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_images_in_and_probabilities_out_through_shared_memory(
    server: Server, regions: list[Any], protocol: str
) -> None:
    files = np.array([png(1), png(2), png(3)], dtype=np.object_)
    serialized = serialize_byte_tensor(files)
    images, images_key = make_region(regions, len(serialized.item()))
    shm.set_shared_memory_region(images, [serialized])
    probs, probs_key = make_region(regions, 4096)
    labels, labels_key = make_region(regions, 4096)
    client(server, protocol).register_system_shared_memory("images", images_key, len(serialized.item()))
    client(server, protocol).register_system_shared_memory("probs", probs_key, 4096)
    client(server, protocol).register_system_shared_memory("labels", labels_key, 4096)

    m = module(protocol)
    image = m.InferInput("image", [3], "BYTES")
    image.set_shared_memory("images", len(serialized.item()))
    outputs = [output(protocol, "probabilities")]
    outputs[0].set_shared_memory("probs", 4096)
    answer = client(server, protocol).infer(MODEL, [image], outputs=outputs)
    got = answer.get_output("probabilities")
    shape = list(got["shape"] if protocol == "http" else got.shape)
    from_shm = shm.get_contents_as_numpy(probs, np.float32, shape)

    plain = m.InferInput("image", [3], "BYTES")
    plain.set_data_from_numpy(files)
    expected = client(server, protocol).infer(MODEL, [plain]).as_numpy("probabilities")
    assert shape == [3, 10]
    np.testing.assert_allclose(from_shm, expected, atol=1e-6)

    # attention maps into a region, at an offset into it
    maps = output(protocol, "attention")
    maps.set_shared_memory("labels", 3072, offset=1024)
    answer = client(server, protocol).infer(MODEL, [image], outputs=[maps], parameters={"attention": "last"})
    got = answer.get_output("attention")
    grid = list(got["shape"] if protocol == "http" else got.shape)
    assert grid[0] == 3 and 4 * np.prod(grid) <= 3072
    from_shm = shm.get_contents_as_numpy(labels, np.float32, grid, offset=1024)
    plain_maps = client(server, protocol).infer(
        MODEL, [plain], outputs=[output(protocol, "attention")], parameters={"attention": "last"}
    )
    np.testing.assert_allclose(from_shm, plain_maps.as_numpy("attention"), atol=1e-6)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_pixels_in_and_embeddings_out_through_shared_memory(server: Server, regions: list[Any], protocol: str) -> None:
    meta = httpx.get(f"{server.url}/v2/models/{MODEL}").json()
    shape = next(t["shape"] for t in meta["inputs"] if t["name"] == "pixels")
    pixels = np.random.default_rng(0).standard_normal([2, *shape[1:]]).astype(np.float32)
    dim = next(t["shape"][1] for t in meta["outputs"] if t["name"] == "embedding")
    inputs, inputs_key = make_region(regions, pixels.nbytes)
    shm.set_shared_memory_region(inputs, [pixels])
    out, out_key = make_region(regions, 2 * dim * 4)
    client(server, protocol).register_system_shared_memory("pixels-in", inputs_key, pixels.nbytes)
    client(server, protocol).register_system_shared_memory("embedding-out", out_key, 2 * dim * 4)

    m = module(protocol)
    tensor = m.InferInput("pixels", list(pixels.shape), "FP32")
    tensor.set_shared_memory("pixels-in", pixels.nbytes)
    wanted = output(protocol, "embedding")
    wanted.set_shared_memory("embedding-out", 2 * dim * 4)
    client(server, protocol).infer(MODEL, [tensor], outputs=[wanted], parameters={"embedding": True})
    from_shm = shm.get_contents_as_numpy(out, np.float32, [2, dim])

    plain = m.InferInput("pixels", list(pixels.shape), "FP32")
    plain.set_data_from_numpy(pixels)
    expected = client(server, protocol).infer(
        MODEL, [plain], outputs=[output(protocol, "embedding")], parameters={"embedding": True}
    )
    np.testing.assert_allclose(from_shm, expected.as_numpy("embedding"), atol=1e-5)


def refused(call: Any, protocol: str, status: int, grpc_code: str, text: str) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call()
    e = caught.value
    assert text in e.message(), e.message()
    if protocol == "http":
        assert e.status() == str(status), e
    else:
        assert e.status() == f"StatusCode.{grpc_code}", e


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_hostile_use_is_refused_with_the_protocols_error(server: Server, regions: list[Any], protocol: str) -> None:
    _, key = make_region(regions, 1024)
    c = client(server, protocol)
    bad = "INVALID_ARGUMENT"
    refused(lambda: c.register_system_shared_memory("r", "/etc/passwd", 16), protocol, 400, bad, "not the name")
    refused(lambda: c.register_system_shared_memory("r", "../passwd", 16), protocol, 400, bad, "not the name")
    refused(
        lambda: c.register_system_shared_memory("r", "/vit-none-" + uuid.uuid4().hex, 16), protocol, 400, bad, "none"
    )
    refused(lambda: c.register_system_shared_memory("r", key, 1025), protocol, 400, bad, "past the end")
    refused(lambda: c.register_system_shared_memory("r", key, 16, offset=2**64 - 1), protocol, 400, bad, "past the end")
    c.register_system_shared_memory("r", key, 64)
    refused(
        lambda: c.register_system_shared_memory("r", key, 16), protocol, 409, "ALREADY_EXISTS", "already registered"
    )

    m = module(protocol)
    image = m.InferInput("image", [1], "BYTES")
    image.set_shared_memory("r", 128, offset=0)  # past the 64 bytes registered
    refused(lambda: c.infer(MODEL, [image]), protocol, 400, bad, "past the end of region 'r'")

    plain = m.InferInput("image", [1], "BYTES")
    plain.set_data_from_numpy(np.array([png(4)], dtype=np.object_))
    small = output(protocol, "probabilities")
    small.set_shared_memory("r", 8)  # ten probabilities need 40 bytes
    refused(lambda: c.infer(MODEL, [plain], outputs=[small]), protocol, 400, bad, "needs 40 bytes")

    c.unregister_system_shared_memory("r")
    after = output(protocol, "probabilities")
    after.set_shared_memory("r", 64)
    refused(
        lambda: c.infer(MODEL, [plain], outputs=[after]), protocol, 400, bad, "no system shared-memory region named 'r'"
    )
    refused(
        lambda: c.get_system_shared_memory_status("r"), protocol, 404, "NOT_FOUND", "no system shared-memory region"
    )

    for i in range(LIMIT):
        c.register_system_shared_memory(f"r{i}", key, 16)
    refused(
        lambda: c.register_system_shared_memory("one-more", key, 16), protocol, 400, bad, "the most this server takes"
    )
    c.unregister_system_shared_memory()
    assert (
        len(c.get_system_shared_memory_status()) == 0
        if protocol == "http"
        else not c.get_system_shared_memory_status().regions
    )

    # CUDA shared memory: not supported, and clearing it succeeds
    raw_handle = b"\0" * 64
    if protocol == "http":
        refused(lambda: c.register_cuda_shared_memory("g", raw_handle, 0, 16), protocol, 400, "", "not supported")
    else:
        refused(
            lambda: c.register_cuda_shared_memory("g", raw_handle, 0, 16), protocol, 0, "UNIMPLEMENTED", "not supported"
        )
    c.unregister_cuda_shared_memory()
    c.unregister_cuda_shared_memory("g")

    # and the server serves on
    assert client(server, protocol).infer(MODEL, [plain]).as_numpy("probabilities").shape == (1, 10)


def test_the_server_lists_system_shared_memory_among_its_extensions(server: Server) -> None:
    assert "system_shared_memory" in httpx.get(f"{server.url}/v2").json()["extensions"]
