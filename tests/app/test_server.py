"""Integration: a real uvicorn process on a free port, spoken to over the network."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from model.shapes import make_sample
from tests.conftest import encode

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    def __init__(self, checkpoint: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        environment = {**os.environ, "VIT_WEIGHTS": str(checkpoint), "VIT_DEVICE": "cpu", **env}
        # Output goes to a file, not a pipe: an unread pipe fills up and blocks the server's logging.
        self.output = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(self.port),
             "--timeout-graceful-shutdown", "20"],
            cwd=ROOT, env=environment, stdout=self.output, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def read_output(self) -> str:
        if self.output.closed:
            return self.final_output
        self.output.seek(0)
        return self.output.read()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.read_output()}")
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server did not become ready")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if not self.output.closed:
            self.final_output = self.read_output()
            self.output.close()
        return self.final_output


@pytest.fixture
def server(tiny_checkpoint: Path) -> Iterator[Server]:
    s = Server(tiny_checkpoint, VIT_MAX_BATCH_SIZE="16", VIT_MAX_WAIT_MS="50")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


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
        assert client.get("/v1/model").json()["classes"][0] == "circle"


def test_concurrent_clients_are_batched(server: Server) -> None:
    png = encode(make_sample(3, 1).image)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            rs = await asyncio.gather(
                *(client.post("/predict", files={"file": (f"{i}.png", png, "image/png")}) for i in range(48))
            )
            return [r.status_code for r in rs]

    assert asyncio.run(burst()) == [200] * 48
    text = httpx.get(f"{server.url}/metrics").text
    count = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vit_batch_size_count"))
    total = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vit_batch_size_sum"))
    assert total == 48 and count < 48, (count, total)


def test_sigterm_drains_accepted_requests(tiny_checkpoint: Path) -> None:
    """Requests in flight when SIGTERM arrives are all answered; then the process exits cleanly."""
    s = Server(tiny_checkpoint, VIT_MAX_BATCH_SIZE="4", VIT_MAX_WAIT_MS="20")
    try:
        s.wait_ready()
        png = encode(make_sample(3, 2).image)

        async def in_flight() -> list[int]:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as client:
                tasks = [
                    asyncio.create_task(client.post("/predict", files=[("files", (f"{i}.png", png, "image/png"))] * 4))
                    for i in range(24)
                ]
                await asyncio.sleep(0.3)  # let them connect and be accepted
                s.proc.send_signal(signal.SIGTERM)
                return [r.status_code for r in await asyncio.gather(*tasks)]

        statuses = asyncio.run(in_flight())
        assert statuses == [200] * 24
        # uvicorn re-raises the signal it handled once shutdown is complete: -SIGTERM is its clean exit
        assert s.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        out = s.stop()
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
    assert "invalid settings: VIT_DEVICE:" in out and "VIT_MAX_BATCH_SIZE:" in out
