"""Integration: a real uvicorn process on a free port, spoken to over the network."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from harness.images import encode
from harness.server import Server
from model.shapes import make_sample
from tests.support.checkpoints import heavy_checkpoint, write_tiny_checkpoint
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def server(serve: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> Server:
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("server") / "tiny.safetensors")
    return serve(checkpoint, VIT_MAX_BATCH_SIZE="16", VIT_MAX_WAIT_MS="50")


def test_predictions_over_the_network(server: Server) -> None:
    png = encode(make_sample(3, 0).image)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/predict", files={"file": ("a.png", png, "image/png")}, params={"attention": "rollout"})
        assert r.status_code == 200, r.text
        result = r.json()["results"][0]
        assert sum(result["probabilities"]) == pytest.approx(1.0, abs=1e-5)
        assert result["attention"]["grid"] == [4, 4]
        r = client.post("/predict", files=[("files", (f"{i}.png", png, "image/png")) for i in range(3)])
        assert r.status_code == 200 and len(r.json()["results"]) == 3
        r = client.post("/predict", content=png, headers={"content-type": "image/png"})
        assert r.status_code == 200, r.text
        assert client.post("/predict", content=b"junk", headers={"content-type": "image/png"}).status_code == 415
        info = client.get("/v1/model").json()
        assert info["classes"][0] == "circle"
        assert info["backend"] == "onnxruntime"  # the default on the CPU


def test_concurrent_clients_are_batched(serve: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> None:
    """48 clients at once share batches: one thread's forward pass of the heavy model outlasts the handling of
    a request, so while one batch computes the others queue, however busy the machine is."""
    heavy = heavy_checkpoint(tmp_path_factory.mktemp("heavy") / "heavy.safetensors")
    server = serve(heavy, VIT_THREADS="1", VIT_MAX_BATCH_SIZE="16", VIT_MAX_WAIT_MS="50", VIT_BACKEND="torch")
    png = encode(make_sample(3, 1).image)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            rs = await asyncio.gather(
                *(client.post("/predict", files={"file": (f"{i}.png", png, "image/png")}) for i in range(48))
            )
            return [r.status_code for r in rs]

    def batches() -> tuple[float, float]:
        """The server's batch count and image total so far."""
        lines = httpx.get(f"{server.url}/metrics").text.splitlines()
        count = sum(float(line.split()[-1]) for line in lines if line.startswith("vit_batch_size_count"))
        total = sum(float(line.split()[-1]) for line in lines if line.startswith("vit_batch_size_sum"))
        return count, total

    count_before, total_before = batches()
    assert asyncio.run(burst()) == [200] * 48
    count, total = (after - before for after, before in zip(batches(), (count_before, total_before), strict=True))
    assert total == 48 and count < 48, (count, total)


def test_sigterm_drains_accepted_requests(tiny_checkpoint: Path) -> None:
    """Requests in flight when SIGTERM arrives are all answered; then the process exits cleanly."""
    with Server(tiny_checkpoint, VIT_MAX_BATCH_SIZE="4", VIT_MAX_WAIT_MS="20") as s:
        png = encode(make_sample(3, 2).image)

        async def in_flight() -> list[int]:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as client:
                tasks = [
                    asyncio.create_task(client.post("/predict", files=[("files", (f"{i}.png", png, "image/png"))] * 4))
                    for i in range(24)
                ]
                await s.until_accepted("http", "/predict", 24)  # every request taken (in flight or answered)
                s.proc.send_signal(signal.SIGTERM)
                return [r.status_code for r in await asyncio.gather(*tasks)]

        statuses = asyncio.run(in_flight())
        assert statuses == [200] * 24
        assert s.proc.wait(timeout=30) == 0
    out = s.stop()  # everything it wrote
    assert "stopped" in out
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{s.url}/health/live", timeout=2)  # new connections are refused


def start_and_fail(checkpoint: Path, **env: str) -> str:
    s = Server(checkpoint, **env)
    code = s.proc.wait(timeout=60)
    out = s.stop()
    assert code == 3, out
    assert "Traceback" not in out
    return out


def test_broken_checkpoint_exits_with_one_clear_message(tmp_path: Path) -> None:
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"not a checkpoint")
    out = start_and_fail(bad)
    assert f"startup failed: checkpoint {bad}: not a readable safetensors file" in out


def test_missing_checkpoint_exits_with_one_clear_message(tmp_path: Path) -> None:
    out = start_and_fail(tmp_path / "absent.safetensors")
    assert "absent.safetensors: file not found" in out


def test_bad_settings_exit_with_one_clear_message(tiny_checkpoint: Path) -> None:
    out = start_and_fail(tiny_checkpoint, VIT_MAX_BATCH_SIZE="zero", VIT_DEVICE="gpu")
    # each variable named once: a check's own message that names it is not prefixed with it again
    assert "invalid settings: VIT_DEVICE must be auto, cpu, cuda or cuda:N, got 'gpu'; VIT_MAX_BATCH_SIZE:" in out
    assert out.count("VIT_DEVICE") == 1 and "Value error" not in out
