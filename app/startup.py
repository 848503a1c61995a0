"""What `python -m app` does before it loads anything: the settings read and checked, and how a failed
start ends (one log line, exit code 3). Light on purpose: a bad setting is reported before the serving
stack (torch, the web and gRPC servers) is imported."""

from __future__ import annotations

import logging
import os
from typing import Any

from pydantic import ValidationError

from app.settings import Settings, configured_names, unknown_variables
from app.telemetry.logs import configure_logging

log = logging.getLogger("app")

STARTUP_FAILED_EXIT_CODE = 3


def startup_errors() -> tuple[type[Exception], ...]:
    """What a bad setting, checkpoint or port raises at startup."""
    from model.checkpoint import CheckpointError  # here: front-end processes never read a checkpoint

    return (ValidationError, CheckpointError, ValueError, OSError)


def describe_startup_error(e: Exception) -> str:
    """One line that says what to fix."""
    if isinstance(e, ValidationError):
        return "invalid settings: " + "; ".join(map(settings_problem, e.errors()))
    return str(e)


def settings_problem(err: Any) -> str:
    """One problem: the variable and what is wrong; a check across settings names its variables itself."""
    message = str(err["msg"]).removeprefix("Value error, ")
    variable = f"VIT_{'.'.join(map(str, err['loc'])).upper()}"
    if not err["loc"] or message.startswith(variable):
        return message
    return f"{variable}: {message}"


def read_settings() -> Settings:
    """Settings from VIT_* variables (and .env), naming the VIT_ variables that set nothing."""
    settings = Settings()
    configure_logging(settings.log_level, settings.log_format)
    for message in unknown_variables(configured_names()):
        log.warning(message)
    return settings


def startup_failed(e: Exception) -> int:
    # The settings may be what failed: the format is read as given, text unless it says json.
    configure_logging("info", "json" if os.environ.get("VIT_LOG_FORMAT", "").lower() == "json" else "text")
    log.critical("startup failed: %s", describe_startup_error(e))
    return STARTUP_FAILED_EXIT_CODE
