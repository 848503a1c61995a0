"""Health through a start and a drain, as an orchestrator's probes and a client meet it: the HTTP listener is up
before the models load and until the drain ends; `/health/ready` answers 503 and gRPC `ServerReady` false while
the models load and from SIGTERM on; inference then gets 503 `not ready` (loading) or `draining` (with
`Connection: close`), never a refused connection; the requests accepted before SIGTERM are answered, and those
still running when VIT_DRAIN_TIMEOUT_S runs out get 503 `draining: not finished within VIT_DRAIN_TIMEOUT_S`.

The service runs over the device stand-in (`harness.stand_in`), whose model load takes LOAD_S longer (a hub
download) and whose forward is slow enough to keep requests in flight through a SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import grpc
import httpx
import pytest

from app.codecs.proto import messages_pb2 as pb
from app.codecs.proto.service_pb2_grpc import GRPCInferenceServiceStub
from app.core.contract.errors import DRAIN_TIMED_OUT
from harness.images import photo_jpeg
from harness.models import stand_in_checkpoint
from harness.server import ServerProcess, free_port
from harness.stand_in import stand_in_server
from tests.support.grpc_requests import image_request

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
LOAD_S = 4.0  # the stand-in's model load, longer by this
JPEG = photo_jpeg(0)
REFUSED = "refused"
DRAINED = "drained: the accepted requests answered; the listeners close"
CLOSED = "closed unanswered"  # the connection closed under a request: as the listener closes at the drain's end


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stand_in_checkpoint(tmp_path_factory.mktemp("health") / "m.safetensors", classes=10)


def served(checkpoint: Path, how: str, slower: float, drain_s: float) -> tuple[ServerProcess, str]:
    """The stand-in service as `how` runs it (`workers-1`, `workers-2`: python -m app; `uvicorn`: uvicorn
    app.main:app), not yet waited for, and its gRPC target."""
    grpc_port = free_port()
    env = {"VIT_GRPC_PORT": str(grpc_port), "VIT_DRAIN_TIMEOUT_S": str(drain_s), "VIT_LOG_LEVEL": "info"}
    if how.startswith("workers-"):
        env["VIT_WORKERS"] = how.removeprefix("workers-")
    server = stand_in_server(checkpoint, "vit-b16", slower, load_s=LOAD_S, uvicorn=how == "uvicorn", **env)
    return server, f"127.0.0.1:{grpc_port}"


async def http_status(client: httpx.AsyncClient, method: str, path: str, **kwargs: object) -> int | str:
    try:
        return (await client.request(method, path, timeout=3, **kwargs)).status_code  # type: ignore[arg-type]
    except httpx.ConnectError:
        return REFUSED
    except (httpx.ReadError, httpx.RemoteProtocolError):
        return CLOSED


async def grpc_ready(target: str) -> bool | str:
    """ServerReady on a channel of its own, as a probe connects (a shared channel, once refused, waits out its
    reconnection backoff)."""
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            return bool((await GRPCInferenceServiceStub(channel).ServerReady(pb.ServerReadyRequest(), timeout=3)).ready)
    except grpc.aio.AioRpcError as e:
        return REFUSED if e.code() == grpc.StatusCode.UNAVAILABLE else e.code().name


async def grpc_infer(target: str) -> str:
    """A new ModelInfer call's outcome, on a channel of its own: OK, or the status code and its message's start."""
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            await GRPCInferenceServiceStub(channel).ModelInfer(image_request(JPEG, model="m"), timeout=3)
        return "OK"
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE and not (e.details() or "").startswith(("draining", "not ready")):
            return REFUSED
        return f"{e.code().name} {(e.details() or '').split(':')[0]}"


def after_first_answer(seen: list[int | str | bool]) -> list[int | str | bool]:
    """What the polls got from the first one answered on: before it, the interpreter had not started listening."""
    first = next((i for i, got in enumerate(seen) if got != REFUSED), len(seen))
    return seen[first:]


async def through_start(server: ServerProcess, target: str) -> dict[str, list[int | str | bool]]:
    """Polls every 0.1 s from the process's start until /health/ready answers 200."""
    seen: dict[str, list[int | str | bool]] = {"ready": [], "live": [], "v2 ready": [], "grpc": [], "predict": []}
    details: list[tuple[str, bool]] = []
    deadline = time.monotonic() + 120
    async with httpx.AsyncClient(base_url=server.url) as client:
        while (ready := await http_status(client, "GET", "/health/ready")) != 200:
            assert time.monotonic() < deadline and server.proc.poll() is None, server.read_output()[-3000:]
            seen["ready"].append(ready)
            seen["grpc"].append(await grpc_ready(target))
            if ready != REFUSED:
                seen["live"].append(await http_status(client, "GET", "/health/live"))
                seen["v2 ready"].append(await http_status(client, "GET", "/v2/health/ready"))
                r = await client.post("/predict", content=JPEG, headers={"content-type": "image/jpeg"}, timeout=3)
                if r.status_code == 200:  # loaded since readiness was asked: the next poll finds it ready
                    continue
                seen["predict"].append(r.status_code)
                details.append((r.json()["detail"], "retry-after" in r.headers))
            await asyncio.sleep(0.1)
    seen["details"] = details  # type: ignore[assignment]
    return seen


async def through_drain(
    server: ServerProcess, target: str, grpc_calls: int = 4, posts: int = 8
) -> tuple[dict[str, list[int | str | bool]], list[int], list[str], list[str]]:
    """`posts` /predict requests and `grpc_calls` ModelInfer calls in flight, SIGTERM, then polls until every one is
    answered: what the polls got, the posts' statuses and details, and the calls' outcomes."""
    seen: dict[str, list[int | str | bool]] = {"ready": [], "grpc": [], "grpc infer": [], "predict": []}
    headers = {"content-type": "image/jpeg"}
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = GRPCInferenceServiceStub(channel)
        http_before = await asyncio.to_thread(server.accepted, "http", "/predict")
        grpc_before = await asyncio.to_thread(server.accepted, "grpc", "ModelInfer")
        sent = [asyncio.create_task(client.post("/predict", content=JPEG, headers=headers)) for _ in range(posts)]
        called = [asyncio.ensure_future(stub.ModelInfer(image_request(JPEG, model="m"))) for _ in range(grpc_calls)]
        await server.until_accepted("http", "/predict", http_before + posts)
        await server.until_accepted("grpc", "ModelInfer", grpc_before + grpc_calls)
        in_flight = [*sent, *called]
        os.killpg(server.proc.pid, signal.SIGTERM)  # as `kill %1` does: serving processes have sessions of their own
        polls: list[tuple[str, float, int | str | bool]] = []
        async with httpx.AsyncClient(base_url=server.url) as poller:
            while not all(t.done() for t in in_flight):
                polls.append(("ready", time.time(), await http_status(poller, "GET", "/health/ready")))
                polls.append(("grpc", time.time(), await grpc_ready(target)))
                polls.append(("grpc infer", time.time(), await grpc_infer(target)))
                started = time.time()
                try:
                    r = await poller.post("/predict", content=JPEG, headers=headers, timeout=3)
                except httpx.ConnectError:
                    polls.append(("predict", started, REFUSED))
                    continue
                except (httpx.ReadError, httpx.RemoteProtocolError):  # kept only if sent before the drain's end
                    polls.append(("predict", started, CLOSED))
                    continue
                polls.append(("predict", started, r.status_code))
                assert r.status_code != 503 or (
                    r.json()["detail"].startswith("draining") and r.headers.get("connection") == "close"
                ), (r.headers, r.text)
                await asyncio.sleep(0.1)
        # the drain ends when the server has answered what it accepted, and logs so before its listeners close:
        # what a poll sent before that line got (the client takes in the last answer a little later)
        drained = await drained_at(server)
        for kind, at, got in polls:
            if at < drained:
                seen[kind].append(got)
        answers = await asyncio.gather(*sent)
        outcomes = []
        for call in called:
            try:
                outcomes.append(f"OK {len((await call).outputs)}")
            except grpc.aio.AioRpcError as e:
                outcomes.append(f"{e.code().name} {e.details()}")
    return seen, [r.status_code for r in answers], [r.text for r in answers], outcomes


async def drained_at(server: ServerProcess, timeout: float = 60) -> float:
    """When the server (its first serving process, with several) logged that the drain had answered what it
    accepted, as seconds since the epoch: the time its listeners began to close."""
    deadline = time.monotonic() + timeout
    while not (times := [logged_at(line) for line in server.read_output().splitlines() if DRAINED in line]):
        assert time.monotonic() < deadline, server.read_output()[-3000:]
        await asyncio.sleep(0.05)
    return min(times)


def logged_at(line: str) -> float:
    """A text log line's time (`%(asctime)s`: local time, to the millisecond, truncated)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.fixture
def stopped_servers() -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    yield servers
    for server in servers:
        server.stop()


@pytest.mark.parametrize("how", ["workers-1", "workers-2", "uvicorn"])
def test_not_ready_never_refused_through_start_and_drain(
    checkpoint: Path, how: str, stopped_servers: list[ServerProcess]
) -> None:
    """While the models load: live 200, ready 503, ServerReady false, /predict 503 `not ready` without Retry-After.
    From SIGTERM until every accepted request is answered: ready 503, ServerReady false, /predict 503 `draining`,
    the accepted requests 200. Never a refused connection from the listener's first answer to the drain's end."""
    server, target = served(checkpoint, how, slower=300, drain_s=30)
    stopped_servers.append(server)

    async def run() -> tuple[dict[str, list[int | str | bool]], tuple[object, ...]]:
        return await through_start(server, target), await through_drain(server, target)

    start, (drain, statuses, texts, outcomes) = asyncio.run(run())
    ready = after_first_answer(start["ready"])
    assert ready and set(ready) == {503}, start  # listening before the models loaded, never refused after
    v2_ready = start["v2 ready"]  # 503, then 200 where the models finished loading after /health/ready was asked
    assert set(start["live"]) == {200} and 503 in v2_ready and v2_ready == sorted(v2_ready, reverse=True), start
    assert set(start["predict"]) == {503}, start
    assert {d for d, _ in start["details"]} == {"not ready: the models are loading; retry shortly"}, start  # type: ignore[misc]
    assert not any(retry for _, retry in start["details"]), start  # type: ignore[misc]
    served_grpc = after_first_answer(start["grpc"])  # not ready, then ready once loaded (asked after HTTP's poll)
    assert REFUSED not in served_grpc and False in served_grpc and served_grpc == sorted(served_grpc), start
    assert statuses == [200] * 8, texts
    assert outcomes == ["OK 1"] * 4, outcomes
    assert drain["ready"] and set(drain["ready"]) == {503}, drain  # every poll answered: no refused connection
    assert set(drain["grpc"]) == {False} and set(drain["predict"]) == {503}, drain
    assert set(drain["grpc infer"]) == {"UNAVAILABLE draining"}, drain
    assert server.proc.wait(timeout=60) in (0, -signal.SIGTERM), server.read_output()[-3000:]  # uvicorn re-raises


def test_requests_still_running_when_the_drain_runs_out_get_503_draining(
    checkpoint: Path, stopped_servers: list[ServerProcess]
) -> None:
    """A forward longer than VIT_DRAIN_TIMEOUT_S: the requests it holds are answered 503 (HTTP) and UNAVAILABLE
    (gRPC) with DRAIN_TIMED_OUT when the drain time is out; the log has one line with their count and no
    traceback."""
    server, target = served(checkpoint, "workers-1", slower=4000, drain_s=1)
    stopped_servers.append(server)
    server.wait_ready(timeout=120)

    _, statuses, texts, outcomes = asyncio.run(through_drain(server, target, grpc_calls=2, posts=2))
    assert statuses == [503, 503], texts
    assert all(DRAIN_TIMED_OUT in text for text in texts), texts
    assert outcomes == [f"UNAVAILABLE {DRAIN_TIMED_OUT}"] * 2, outcomes
    assert server.proc.wait(timeout=60) == 0
    out = server.stop()
    assert "draining: 4 requests not finished within VIT_DRAIN_TIMEOUT_S (1 s) answered 503 draining" in out, out
    assert "Traceback" not in out, out


def test_sigterm_while_the_models_load_stops_the_start_cleanly(
    checkpoint: Path, stopped_servers: list[ServerProcess]
) -> None:
    """SIGTERM while the models load: the service never turns ready, refuses nothing it accepted, lets the load
    finish and exits 0 with no traceback."""
    server, _ = served(checkpoint, "workers-1", slower=1, drain_s=5)
    stopped_servers.append(server)
    deadline = time.monotonic() + 60
    while (ready := http_ready_status(server)) != 503:
        assert ready != 200 and time.monotonic() < deadline, server.read_output()[-3000:]
        time.sleep(0.05)
    os.killpg(server.proc.pid, signal.SIGTERM)
    while server.proc.poll() is None:
        assert http_ready_status(server) in (503, REFUSED)  # never ready; refused once the drain has ended
        time.sleep(0.05)
    out = server.stop()
    assert server.proc.returncode == 0, out
    assert "ready: HTTP" not in out and "Traceback" not in out, out


def http_ready_status(server: ServerProcess) -> int | str:
    try:
        return httpx.get(server.url + "/health/ready", timeout=3).status_code
    except (httpx.ConnectError, httpx.RemoteProtocolError):  # closed, or closing as the drain ends
        return REFUSED
