"""The settings of a test's engine, written once."""

from __future__ import annotations

from typing import Any

from app.settings import Settings


def cpu_settings(**overrides: Any) -> Settings:
    """The CPU, torch (no ONNX export to wait for), no warm-up; `overrides` (settings' field names) on top."""
    return Settings(**{"device": "cpu", "backend": "torch", "warmup": False, **overrides})
