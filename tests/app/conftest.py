from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.core.engine.engine import Engine
from tests.support.clients import ClientFactory, client_factory
from tests.support.settings import cpu_settings


@pytest.fixture
def make_client(tiny_checkpoint: Path) -> ClientFactory:
    """`async with make_client(max_batch_size=4) as client:` — the app with its lifespan run, in process.

    The backend is torch unless a test asks for another: exporting the ONNX graph costs about 2 s per
    app. The ONNX Runtime backend (the CPU default) has its own tests through the same routes
    (tests/app/core/backends/test_onnx_runtime.py), and the real-server tests run the default.
    """
    return client_factory(tiny_checkpoint)


@pytest.fixture
async def client(make_client: ClientFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client() as c:
        yield c


@pytest.fixture
async def service(tiny_checkpoint: Path) -> AsyncIterator[Engine]:
    """The core alone, no edge: the tiny checkpoint on the CPU with torch, started on this test's event loop."""
    settings = cpu_settings(weights=tiny_checkpoint, max_batch_size=4)
    async with Engine.serving(settings) as engine:
        yield engine
