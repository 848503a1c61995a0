"""End-to-end tests: the service as real processes (`python -m app`), spoken to over the network by real
clients. `serve` is the one way a module starts the servers its tests share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.server import Server
from tests.support.servers import ServerFactory


@pytest.fixture(scope="module")
def serve() -> Iterator[ServerFactory]:
    """`serve(checkpoint, VIT_...="...")`: `python -m app` started and ready, stopped (with every process it
    started) once the module's tests are done."""
    with contextlib.ExitStack() as started:

        def start(checkpoint: Path, **env: str) -> Server:
            return started.enter_context(Server(checkpoint, **env))

        yield start
