"""VIT_LOG_FORMAT=json from a real server: every line of the app and uvicorn alike one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from harness.server import Server
from tests.support.checkpoints import write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_python_m_app_writes_every_line_as_json(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny.safetensors")
    with Server(checkpoint, VIT_LOG_FORMAT="json", VIT_BACKEND="torch") as server:
        r = httpx.post(f"{server.url}/predict", content=b"not an image", headers={"content-type": "image/png"})
        assert r.status_code == 415
        request_id = r.headers["x-request-id"]
        output = server.stop()
    lines = [json.loads(line) for line in output.splitlines() if line.strip()]  # every line parses
    loggers = {line["logger"] for line in lines}
    assert {"app", "app.access", "uvicorn.error"} <= loggers, loggers
    assert "uvicorn.access" not in loggers  # one access line a request: the app's
    (access,) = [line for line in lines if line.get("request_id") == request_id]
    assert access["logger"] == "app.access" and "POST /predict 415" in access["message"]
    assert access["client"].startswith("127.0.0.1:") and f"client={access['client']}" in access["message"]


def test_a_startup_failure_is_one_json_line_too(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny.safetensors")
    server = Server(checkpoint, VIT_LOG_FORMAT="json", VIT_MAX_BATCH_SIZE="zero")
    assert server.proc.wait(timeout=60) == 3
    lines = [json.loads(line) for line in server.stop().splitlines() if line.strip()]
    (failure,) = [line for line in lines if line["level"] == "CRITICAL"]
    assert failure["message"].startswith("startup failed: invalid settings: VIT_MAX_BATCH_SIZE:")
