"""VIT_WORKERS=2: two front-end processes over one engine process, as `python -m app` runs them.

The same answers as one process, over HTTP and gRPC; one model state (a repository change seen by every
front-end once it is answered); one /metrics; a front-end or the engine killed with SIGKILL and started
again while the rest serve or answer 503; no process left behind when the supervisor is killed.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from app.codecs.proto.service_pb2_grpc import GRPCInferenceServiceStub
from app.workers.link import ENGINE_SILENT_S
from harness.images import encode
from harness.server import Server
from model.shapes import make_sample
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.clients import client_factory
from tests.support.grpc_requests import image_request, probabilities
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
PNGS = [encode(make_sample(i, i % 10).image) for i in range(3)]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("repository")
    write_tiny_checkpoint(folder / "tiny.safetensors", seed=0)
    write_tiny_checkpoint(folder / "other.safetensors", seed=1)
    return folder


@pytest.fixture(scope="module")
def server(serve: ServerFactory, repository: Path) -> Server:
    env = {
        "VIT_WORKERS": "2",
        "VIT_BACKEND": "torch",
        "VIT_MODEL_REPOSITORY": str(repository),
        "VIT_MODEL_CONTROL": "explicit",
        "VIT_MODELS": "tiny",
    }
    s = serve(repository / "tiny.safetensors", **env)
    wait_for(lambda: len(front_end_pids(s)) == 2, 60)
    return s


def kill_and_wait(pid: int) -> float:
    """SIGKILL `pid` (not a child of this process) and return once it is dead, its sockets closed."""
    fd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        assert select.select([fd], [], [], 10)[0], f"pid {pid} still alive 10 s after SIGKILL"
        return time.monotonic()
    finally:
        os.close(fd)


def wait_for(condition: object, timeout: float) -> float:
    """Seconds until `condition()` held; fails after `timeout`."""
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - started < timeout, "condition not reached in time"
        time.sleep(0.05)
    return time.monotonic() - started


def front_end_pids(s: Server) -> list[int]:
    """The front-ends connected to the engine now (the log says when each connects; the dead are skipped)."""
    pids = [int(p) for p in re.findall(r"engine: front-end pid (\d+) connected", s.read_output())]
    return [p for p in dict.fromkeys(pids) if alive(p)]


def engine_pid(s: Server) -> int:
    return int(re.findall(r"engine \(pid (\d+)\) serving", s.read_output())[-1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def fresh(url: str, path: str, method: str = "GET", **kwargs: object) -> httpx.Response:
    """One request on a new connection, so the kernel may hand it to either front-end."""
    with httpx.Client(base_url=url, timeout=30) as client:
        return client.request(method, path, **kwargs)  # type: ignore[arg-type]


def predict_files() -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("files", (f"{i}.png", png, "image/png")) for i, png in enumerate(PNGS)]


async def test_the_answers_are_those_of_one_process(server: Server, repository: Path) -> None:
    """Probabilities, attention maps, overlays and embeddings through the engine process are exactly those
    of the same checkpoint served in one process; gRPC answers the same probabilities."""
    query = "?attention=rollout&overlay=true&embedding=true&top_k=10"
    async with client_factory(repository / "tiny.safetensors")() as client:
        expected = (await client.post("/predict" + query, files=predict_files())).json()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        got = (await http.post("/predict" + query, files=predict_files())).json()
    assert got["model"] == expected["model"]
    assert all(r["overlay_png"] and r["attention"] and r["embedding"] for r in got["results"])
    assert got["results"] == expected["results"]  # the same bytes: through shared memory, nothing is lost
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        response = await GRPCInferenceServiceStub(channel).ModelInfer(image_request(*PNGS, model="tiny"))
    best = probabilities(response).max(axis=1)
    np.testing.assert_allclose(best, [r["top_k"][0]["probability"] for r in got["results"]], atol=1e-6)


def test_both_front_ends_serve_and_metrics_count_all_of_them(server: Server) -> None:
    before = predict_count(fresh(server.url, "/metrics").text)
    statuses = [fresh(server.url, "/predict", "POST", files=predict_files()).status_code for _ in range(20)]
    assert statuses == [200] * 20
    # each scrape lands on either front-end; every one sees the requests both served
    counts = {predict_count(fresh(server.url, "/metrics").text) for _ in range(10)}
    assert counts == {before + 20}
    metrics = fresh(server.url, "/metrics").text
    assert re.search(r'vit_images_processed_total\{model="tiny"\} \d+', metrics)
    # the statistics extension too: the engine keeps them, so every front-end answers the same
    answered = {
        fresh(server.url, "/v2/models/tiny/stats").json()["model_stats"][0]["inference_count"] for _ in range(6)
    }
    assert len(answered) == 1 and answered.pop() >= 20 * len(PNGS)


def predict_count(metrics: str) -> int:
    found = re.search(r'vit_requests_total\{protocol="http",route="/predict",status="200"\} ([\d.]+)', metrics)
    return int(float(found.group(1))) if found else 0


def test_a_repository_change_is_seen_by_every_front_end_once_answered(server: Server) -> None:
    assert fresh(server.url, "/v2/models/other/ready").status_code == 404
    assert fresh(server.url, "/v2/repository/models/other/load", "POST").status_code == 200
    assert [fresh(server.url, "/v2/models/other/ready").status_code for _ in range(10)] == [200] * 10
    versions = {fresh(server.url, "/v2/models/other").json()["versions"][0] for _ in range(6)}
    assert len(versions) == 1
    index = fresh(server.url, "/v2/repository/index", "POST").json()
    assert {m["name"]: m["state"] for m in index} == {"tiny": "READY", "other": "READY"}
    assert fresh(server.url, "/v2/repository/models/other/unload", "POST").status_code == 200
    assert [fresh(server.url, "/v2/models/other/ready").status_code for _ in range(10)] == [404] * 10


def test_a_killed_front_end_is_started_again_while_the_other_serves(server: Server) -> None:
    """Only the requests the killed process held fail: each failure is a request sent before it died and not
    answered by then, and every request sent after its death is answered."""
    [victim, survivor] = front_end_pids(server)[:2]

    async def load_while_killing() -> tuple[list[int | str], list[float], float]:
        answered_at = [0.0] * 60

        async def one(i: int) -> int | str:
            try:
                async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                    return (await client.post("/predict", files=predict_files())).status_code
            except httpx.TransportError as e:
                return type(e).__name__
            finally:
                answered_at[i] = time.monotonic()

        tasks: list[asyncio.Task[int | str]] = []
        died_at = 0.0
        for i in range(60):
            tasks.append(asyncio.create_task(one(i)))
            if i == 20:
                died_at = kill_and_wait(victim)
            await asyncio.sleep(0.05)
        return list(await asyncio.gather(*tasks)), answered_at, died_at

    results, answered_at, died_at = asyncio.run(load_while_killing())
    wait_for(lambda: len(front_end_pids(server)) == 2, 30)  # started again (how soon is not a test's measure)
    assert survivor in front_end_pids(server) and victim not in front_end_pids(server)
    failed = [i for i, r in enumerate(results) if r != 200]
    held = [i for i in range(21) if answered_at[i] > died_at]  # sent before the death, not answered by then
    print(f"{len(failed)} of {len(results)} requests failed; {len(held)} were under way when the front-end died")
    assert set(failed) <= set(held), (results, held)
    assert all(isinstance(results[i], str) for i in failed), results  # broken connections, never an error status
    assert results[21:] == [200] * 39, results
    assert re.search(
        rf"front-end \d \(pid {victim}\) exited with signal SIGKILL: starting it again", server.read_output()
    )


def test_a_killed_engine_turns_every_front_end_unready_then_comes_back(server: Server) -> None:
    engine = engine_pid(server)
    os.kill(engine, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: all(fresh(server.url, "/health/ready").status_code == 503 for _ in range(6)), 10)
    unready_after = time.monotonic() - killed_at
    # noticed through the engine's pidfd, not after the heartbeat's silence (a bound on the mechanism, not speed)
    assert unready_after < ENGINE_SILENT_S, unready_after
    r = fresh(server.url, "/predict", "POST", files=predict_files())
    assert r.status_code == 503 and "engine process stopped" in r.json()["detail"]
    pids_before = set(front_end_pids(server))
    wait_for(lambda: fresh(server.url, "/health/ready").status_code == 200, 60)
    wait_for(lambda: all(fresh(server.url, "/health/ready").status_code == 200 for _ in range(6)), 10)
    assert engine_pid(server) != engine
    assert set(front_end_pids(server)) >= pids_before  # the front-ends were not restarted
    assert fresh(server.url, "/predict", "POST", files=predict_files()).status_code == 200


def test_every_process_stops_by_itself_when_the_supervisor_is_killed(repository: Path) -> None:
    """SIGKILL leaves the supervisor no time to stop anything: the engine, the front-ends and the fork server
    they were forked from each notice it and exit, none left behind."""
    with Server(repository / "tiny.safetensors", VIT_WORKERS="2", VIT_BACKEND="torch") as s:
        wait_for(lambda: len(front_end_pids(s)) == 2, 60)
        fork_servers = {parent(p) for p in front_end_pids(s)} - {s.proc.pid}
        children = [engine_pid(s), *front_end_pids(s), *fork_servers]
        assert len(children) == 4, children
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait()
        wait_for(lambda: not any(alive(p) for p in children), 15)


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
