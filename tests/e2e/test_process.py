"""`python -m app`, the process's owner: HTTP and gRPC over one engine, one joint drain, one-line startup failures."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from app.codecs.proto import messages_pb2 as pb
from app.codecs.proto.service_pb2_grpc import GRPCInferenceServiceStub
from app.settings import BUNDLED_WEIGHTS
from harness.images import encode
from harness.preloaded import run_command
from harness.server import Server, ServerProcess, free_ports
from model.shapes import make_sample
from tests.support.grpc_requests import image_request

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
PNG = encode(make_sample(3, 2).image)
DRAIN_S = 10


async def http_ready(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1) as client:
            return (await client.get(url + "/health/ready")).status_code == 200
    except httpx.TransportError:  # the listener is closed: not ready
        return False


async def grpc_ready(stub: GRPCInferenceServiceStub) -> bool:
    try:
        return bool((await stub.ServerReady(pb.ServerReadyRequest(), timeout=1)).ready)
    except grpc.aio.AioRpcError:  # no new calls taken: not ready
        return False


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_drains_http_and_grpc_together(workers: str) -> None:
    """With calls of both protocols in flight, SIGTERM turns both not-ready at once, every accepted call is
    answered, and the process exits 0 within VIT_DRAIN_TIMEOUT_S plus a few seconds; with VIT_WORKERS=2,
    every front-end drains so, then the engine stops."""
    env = {
        "VIT_MAX_BATCH_SIZE": "4",
        "VIT_MAX_FILES": "8",
        "VIT_DRAIN_TIMEOUT_S": str(DRAIN_S),
        "VIT_WORKERS": workers,
    }
    with Server(BUNDLED_WEIGHTS, **env) as s:

        async def in_flight() -> tuple[list[int], list[int], dict[str, float], float]:
            files = [("files", (f"{i}.png", PNG, "image/png")) for i in range(8)]
            async with (
                httpx.AsyncClient(base_url=s.url, timeout=60) as client,
                grpc.aio.insecure_channel(s.grpc_target) as channel,
            ):
                stub = GRPCInferenceServiceStub(channel)
                assert await http_ready(s.url) and await grpc_ready(stub)
                posts = [asyncio.create_task(client.post("/predict", files=files)) for _ in range(16)]
                calls = [
                    asyncio.ensure_future(stub.ModelInfer(image_request(*[PNG] * 8, model="vit-shapes")))
                    for _ in range(16)
                ]
                await s.until_accepted("http", "/predict", 16)  # every call taken (in flight or answered)
                await s.until_accepted("grpc", "ModelInfer", 16)
                signalled = time.monotonic()
                os.killpg(s.proc.pid, signal.SIGTERM)  # as `kill %1` does: the supervisor's children have their own
                not_ready: dict[str, float] = {}
                while len(not_ready) < 2 and time.monotonic() - signalled < 5:
                    if "http" not in not_ready and not await http_ready(s.url):
                        not_ready["http"] = time.monotonic() - signalled
                    if "grpc" not in not_ready and not await grpc_ready(stub):
                        not_ready["grpc"] = time.monotonic() - signalled
                    await asyncio.sleep(0.01)
                http_statuses = [r.status_code for r in await asyncio.gather(*posts)]
                grpc_outputs = [len(r.outputs) for r in await asyncio.gather(*calls)]
                return http_statuses, grpc_outputs, not_ready, signalled

        http_statuses, grpc_outputs, not_ready, signalled = asyncio.run(in_flight())
        assert http_statuses == [200] * 16
        assert grpc_outputs == [1] * 16
        assert set(not_ready) == {"http", "grpc"} and max(not_ready.values()) < 1.0, not_ready
        assert s.proc.wait(timeout=DRAIN_S + 5) == 0
        assert time.monotonic() - signalled < DRAIN_S + 5
        out = s.stop()
    assert "draining" in out and "stopped" in out
    assert "engine unavailable" not in out  # the engine stopped only after every front-end had drained


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_port_in_use_exits_3_with_one_line(tiny_checkpoint: Path, protocol: str, workers: str) -> None:
    """A port cannot be bound: whatever was loaded is shut down (one process: the models load first;
    several: no process starts) and the process exits 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if protocol == "http":
            s = Server(tiny_checkpoint, port=port, VIT_BACKEND="torch", VIT_WORKERS=workers)
        else:
            s = Server(tiny_checkpoint, VIT_BACKEND="torch", VIT_GRPC_PORT=str(port), VIT_WORKERS=workers)
        line = failed_start(s)
    assert "cannot listen" in line and str(port) in line


@pytest.mark.parametrize("workers", ["1", "2"])
def test_grpc_on_the_http_port_exits_3_with_one_line(tiny_checkpoint: Path, workers: str) -> None:
    """VIT_GRPC_PORT set to the HTTP port: refused before anything loads, rather than two listeners splitting the
    connections (HTTP's readiness probe answered by gRPC, or by nothing)."""
    [port] = free_ports(1)
    s = Server(tiny_checkpoint, port=port, VIT_BACKEND="torch", VIT_GRPC_PORT=str(port), VIT_WORKERS=workers)
    line = failed_start(s)
    assert f"VIT_GRPC_PORT {port} is the HTTP port too" in line
    assert "loaded" not in s.final_output  # refused before any model is read


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_host_that_is_not_this_machines_exits_3_with_one_line(tiny_checkpoint: Path, workers: str) -> None:
    """--host names no address of this machine (192.0.2.1 is reserved for documentation): the line says to pass
    another host, not to free a port."""
    [port] = free_ports(1)
    env = {**os.environ, "VIT_WEIGHTS": str(tiny_checkpoint), "VIT_DEVICE": "cpu", "VIT_GRPC_PORT": "0"}
    argv = [sys.executable, "-m", "app", "--host", "192.0.2.1", "--port", str(port)]
    done = run_command(argv, {**env, "VIT_BACKEND": "torch", "VIT_WORKERS": workers}, timeout=120)
    line = startup_failure(done.returncode, done.stderr)
    assert "HTTP host 192.0.2.1: not an address of this machine" in line and "pass another --host" in line


@pytest.mark.parametrize("port", ["65536", "-1", "http"])
def test_a_port_that_is_no_port_number_is_a_usage_error(port: str) -> None:
    """Refused by the command line (exit 2, what a port is), before anything is read or loaded."""
    done = run_command([sys.executable, "-m", "app", "--port", port], timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "argument --port" in done.stderr and "is not a port number" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_port_0_serves_on_the_port_the_system_chose_and_says_which(tiny_checkpoint: Path, workers: str) -> None:
    """--port 0: the log names the port HTTP was given, and every front-end serves on that one port."""
    env = {"VIT_WEIGHTS": str(tiny_checkpoint), "VIT_DEVICE": "cpu", "VIT_BACKEND": "torch", "VIT_GRPC_PORT": "0"}
    argv = [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", "0"]
    server = ServerProcess(argv, {**env, "VIT_WORKERS": workers}, 0)
    try:
        deadline = time.monotonic() + 120
        while not (said := re.search(r"HTTP on 127\.0\.0\.1:(\d+)", server.read_output())):
            assert server.proc.poll() is None and time.monotonic() < deadline, server.read_output()
            time.sleep(0.1)
        port = int(said.group(1))
        assert port != 0
        url = f"http://127.0.0.1:{port}"
        body = encode(make_sample(7, 0).image, "PNG")
        while not ready(url):  # the front-ends listen once the supervisor has said where
            assert time.monotonic() < deadline, server.read_output()
            time.sleep(0.1)
        for _ in range(8):  # each on a connection of its own, spread over the front-ends by the kernel
            with httpx.Client(timeout=30) as client:
                r = client.post(url + "/predict", files={"file": ("x.png", body, "image/png")})
                assert r.status_code == 200, r.text
    finally:
        server.stop()


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def failed_start(server: Server) -> str:
    """The line a server that cannot start writes (`startup_failure`), the server stopped whatever happens."""
    try:
        code = server.proc.wait(timeout=60)
    finally:
        out = server.stop()
    return startup_failure(code, out)


def startup_failure(code: int, out: str) -> str:
    """The one `startup failed` line of a start that ended with exit 3 and no traceback."""
    assert code == 3, out[-2000:]
    assert "Traceback" not in out
    [line] = [line for line in out.splitlines() if "startup failed" in line]
    return line
