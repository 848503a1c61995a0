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


async def serve_front_end(host: str, port: int, settings: Settings, plane: EngineClient, stop: asyncio.Event) -> int:
    """Serve until `stop`; then not ready at once, both protocols drained together; the exit code."""
    # Listen only once the engine has answered: a front-end listening before would take its share of the
    # connections on the shared ports and answer not-ready while the others answer ready.
    await plane.start()
    while not await plane.wait_engine(0.5):
        if stop.is_set():
            await plane.shutdown()
            return 0
    serving = Serving(plane, settings, http=(host, port), reuse_port=True)
    try:
        await serving.start()
    except OSError as e:
        return startup_failed(e)
    # As the engine process freezes its heap (Engine.start): everything alive now (torch, the app and its routes)
    # is collected once and frozen, so that the collections requests set off walk only what requests make.
    gc.collect()
    gc.freeze()
    code = await serving.run(stop)
    shutdown_tracing()
    return code
