"""The type of the e2e tests' server factory (`tests/e2e/conftest.py`'s `serve`)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from harness.server import Server


class ServerFactory(Protocol):
    def __call__(self, checkpoint: Path, **env: str) -> Server: ...
