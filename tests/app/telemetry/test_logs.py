"""VIT_LOG_FORMAT: text lines, or one JSON object per line from the app and uvicorn alike."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import httpx
import pytest

from app.telemetry.logs import JsonFormatter
from harness.server import Server
from tests.support.checkpoints import write_tiny_checkpoint


def record(**extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("app.web", logging.INFO, __file__, 1, "served %d images", (3,), None)
    rec.__dict__.update(extra)
    return rec


def test_a_json_line_holds_the_record_and_its_request() -> None:
    line = json.loads(JsonFormatter().format(record(request_id="abc123")))
    assert line["level"] == "INFO" and line["logger"] == "app.web" and line["message"] == "served 3 images"
    assert line["request_id"] == "abc123" and line["timestamp"].endswith("+00:00")
    assert "trace_id" not in line and "exception" not in line


def test_a_traceback_stays_inside_its_json_line() -> None:
    try:
        raise ValueError("broken")
    except ValueError:
        rec = record(exc_info=sys.exc_info(), trace_id="4bf92f3577b34da6a3ce929d0e0e4736", span_id="00f067aa0ba902b7")
    text = JsonFormatter().format(rec)
    assert "\n" not in text
    line = json.loads(text)
    assert "ValueError: broken" in line["exception"]
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and line["span_id"] == "00f067aa0ba902b7"


@pytest.mark.slow
@pytest.mark.e2e
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


@pytest.mark.slow
@pytest.mark.e2e
def test_a_startup_failure_is_one_json_line_too(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny.safetensors")
    server = Server(checkpoint, VIT_LOG_FORMAT="json", VIT_MAX_BATCH_SIZE="zero")
    assert server.proc.wait(timeout=60) == 3
    lines = [json.loads(line) for line in server.stop().splitlines() if line.strip()]
    (failure,) = [line for line in lines if line["level"] == "CRITICAL"]
    assert failure["message"].startswith("startup failed: invalid settings: VIT_MAX_BATCH_SIZE:")
