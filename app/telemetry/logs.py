"""The process's log lines: text for people, or one JSON object per line for log shippers (VIT_LOG_FORMAT).

A JSON line holds `timestamp` (UTC, ISO 8601), `level`, `logger` and `message`, the request's
`request_id` and `client` (address:port) where the line is about one request (and `trace_id` and
`span_id` where a record carries them), and `exception` when a traceback is logged. uvicorn's own lines
use the same format; its access lines are off under `python -m app`, where `app.access` writes one line
a request.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from app.choices import LogFormat

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONTEXT_FIELDS = ("request_id", "client", "trace_id", "span_id")  # set on a record with `extra=`


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in CONTEXT_FIELDS:
            if (value := getattr(record, field, None)) is not None:
                line[field] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


def configure_logging(level: str, fmt: LogFormat = "text") -> None:
    """The app's loggers write to stderr in `fmt` at `level`; calling again changes both."""
    logger = logging.getLogger("app")
    logger.setLevel(level.upper())
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())
        logger.propagate = False
    for handler in logger.handlers:
        handler.setFormatter(formatter(fmt))


def uvicorn_log_config(fmt: LogFormat) -> dict[str, Any] | None:
    """uvicorn's `log_config` for json: its loggers get this formatter (None: keep uvicorn's own config)."""
    if fmt != "json":
        return None
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": handler},
        "loggers": {
            "uvicorn": {"handlers": ["json"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["json"], "level": "INFO", "propagate": False},
        },
    }
