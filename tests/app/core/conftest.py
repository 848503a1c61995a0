from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.core.engine import Engine
from app.settings import Settings


@pytest.fixture
async def service(tiny_checkpoint: Path) -> AsyncIterator[Engine]:
    """The core alone, no edge: the tiny checkpoint on the CPU with torch, started on this test's event loop."""
    settings = Settings(weights=tiny_checkpoint, device="cpu", backend="torch", warmup=False, max_batch_size=4)
    async with Engine.serving(settings) as engine:
        yield engine
