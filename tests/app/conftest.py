from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from app.settings import Settings
from app.web.app import create_app

ROOT = Path(__file__).resolve().parents[2]

ClientFactory = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def make_client(tiny_checkpoint: Path) -> ClientFactory:
    """`async with make_client(max_batch_size=4) as client:` — the app with its lifespan run, in process.

    The backend is torch unless a test asks for another: exporting the ONNX graph costs about 2 s per
    app. The ONNX Runtime backend (the CPU default) has its own tests through the same routes
    (tests/app/test_onnx_backend.py), and the real-server tests run the default.
    """

    @asynccontextmanager
    async def factory(**overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
        settings = Settings(**{"weights": tiny_checkpoint, "device": "cpu", "backend": "torch", **overrides})
        app = create_app(settings)
        async with LifespanManager(app, startup_timeout=60, shutdown_timeout=60) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                client.app = app  # type: ignore[attr-defined]
                yield client

    return factory


@pytest.fixture
async def client(make_client: ClientFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client() as c:
        yield c


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
