"""The app in process over a running engine, behind an httpx client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from app.core.engine.engine import Engine
from app.core.engine.served_model import ServedModel
from app.web.app import create_app
from tests.support.settings import cpu_settings

ClientFactory = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


def client_factory(checkpoint: Path) -> ClientFactory:
    """`async with factory(max_batch_size=4) as client:` serves `checkpoint` with torch on the CPU unless
    overridden; `client.app.state.data_plane` is the engine."""

    @asynccontextmanager
    async def factory(**overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
        settings = cpu_settings(**{"weights": checkpoint, "warmup": True, **overrides})
        async with Engine.serving(settings) as engine:
            app = create_app(engine)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                client.app = app  # type: ignore[attr-defined]
                yield client

    return factory


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait, without blocking the event loop, until `condition()` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def slow_forward(model: ServedModel, seconds: float) -> threading.Event:
    """Make each of this model version's batches take `seconds` longer, so its requests stay in flight; the
    event is set once a batch is under way."""
    under_way, _ = slow_batches(model, seconds)
    return under_way


def slow_batches(model: ServedModel, seconds: float) -> tuple[threading.Event, threading.Event]:
    """`slow_forward`, with a second event set once a batch has ended (after its wait and its forward)."""
    original = model.batcher.run_batch
    under_way, ended = threading.Event(), threading.Event()

    def slow(batch: list[Any]) -> Any:
        under_way.set()
        time.sleep(seconds)
        outputs = original(batch)
        ended.set()
        return outputs

    model.batcher.run_batch = slow
    return under_way, ended
