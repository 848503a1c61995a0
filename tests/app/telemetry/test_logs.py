"""VIT_LOG_FORMAT: text lines, or one JSON object per line from the app and uvicorn alike."""

from __future__ import annotations

import json
import logging
import sys

from app.telemetry.logs import JsonFormatter


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
