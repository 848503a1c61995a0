"""One serving front-end process (VIT_WORKERS > 1): HTTP and gRPC on the ports it shares with the others, over
the engine process through an `EngineClient`."""

from __future__ import annotations

import asyncio
import gc

from app.serving import Serving
from app.settings import Settings
from app.startup import startup_failed
from app.telemetry.tracing import shutdown_tracing
from app.workers.engine_client import EngineClient


async def serve_front_end(
    host: str, port: int, settings: Settings, plane: EngineClient, stop: asyncio.Event, listen_at_once: bool
) -> int:
    """Serve until `stop`; then not ready at once, both protocols drained together; the exit code. With
    `listen_at_once` (the service's start, every front-end starting together) it listens before the engine has
    answered, not ready (503 `not ready`) until then; otherwise (a restart) only once the engine has answered:
    a front-end listening before would take its share of the connections on the shared ports and answer
    not-ready while the others answer ready."""
    await plane.start()
    serving = Serving(plane, settings, http=(host, port), reuse_port=True)
    running: asyncio.Task[int] | None = None
    if listen_at_once:
        try:
            await serving.start()
        except OSError as e:
            return startup_failed(e)
        running = asyncio.create_task(serving.run(stop))
    while not await plane.wait_engine(0.5):
        if stop.is_set():
            break
    if running is None:
        if stop.is_set():  # stopped before it listened
            await plane.shutdown()
            return 0
        try:
            await serving.start()
        except OSError as e:
            return startup_failed(e)
        running = asyncio.create_task(serving.run(stop))
    # As the engine process freezes its heap (Engine.start): everything alive now (torch, the app and its routes)
    # is collected once and frozen, so that the collections requests set off walk only what requests make.
    gc.collect()
    gc.freeze()
    code = await running
    shutdown_tracing()
    return code
