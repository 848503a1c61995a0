"""The process's owner: the engine loaded once, HTTP (uvicorn) and gRPC served side by side, one joint drain.

`python -m app` runs `serve`. On SIGTERM (or SIGINT) both protocols turn not-ready at the same moment
and stop accepting; both drain together within VIT_DRAIN_TIMEOUT_S, then the engine answers what is
left and stops. A bad setting or checkpoint, or a port that cannot be bound, ends the process with
one log line and exit code 3 after shutting down whatever was loaded.

`uvicorn app.main:app` runs `lifespan_app` instead: the same engine and gRPC server, started and
stopped by uvicorn's lifespan, so there uvicorn drains HTTP first and the rest after it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from app.serving import Serving, check_ports
from app.settings import Settings
from app.startup import read_settings, startup_errors, startup_failed
from app.telemetry.logs import configure_logging
from app.telemetry.metrics import Metrics
from app.telemetry.tracing import configure_tracing, shutdown_tracing
from app.web.app import create_app
from app.workers.supervisor import Supervisor
from model.device import resolve_device

log = logging.getLogger("app")


async def serve(host: str, port: int, settings: Settings | None = None) -> int:
    """Load, serve HTTP on host:port and gRPC on VIT_GRPC_PORT until SIGTERM or SIGINT, drain, stop; the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        settings = settings or read_settings()
        configure_logging(settings.log_level, settings.log_format)
        check_ports(port, settings)
        workers = settings.serving_workers(gpu=await asyncio.to_thread(gpu_serving, settings))
        if workers > 1:
            return await Supervisor(host, port, settings, workers).run(stop)
        from app.core.engine.engine import Engine  # here: the supervisor's process never loads the backends

        configure_tracing()  # with OTEL_EXPORTER_OTLP_ENDPOINT set
        engine = await asyncio.to_thread(Engine.load, settings, Metrics())
    except startup_errors() as e:
        return startup_failed(e)
    serving = Serving(engine, settings, http=(host, port))
    try:
        await serving.start()
    except OSError as e:
        return startup_failed(e)
    engine.start(freeze_heap=True)
    log.info("ready: HTTP on %s:%d", host, serving.http_port)
    code = await serving.run(stop)
    shutdown_tracing()  # the spans still buffered
    log.info("stopped")
    return code


def gpu_serving(settings: Settings) -> bool:
    """Whether the models would be served from a GPU (what VIT_WORKERS=auto goes by)."""
    if settings.workers != "auto" or settings.device == "cpu":
        return False
    try:
        return resolve_device(settings.device).type == "cuda"
    except ValueError:
        return False  # the engine says what is wrong with VIT_DEVICE


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class LifespanApp:
    """`uvicorn app.main:app`: an ASGI app whose lifespan loads the engine and starts gRPC, then serves
    `create_app(engine)`; uvicorn drains HTTP, then the lifespan's shutdown drains gRPC and the engine."""

    def __init__(self) -> None:
        self.app: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        else:
            raise RuntimeError("the app serves after its lifespan has started (uvicorn's default, --lifespan on)")

    async def lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            settings = read_settings()
            if settings.workers not in ("1", "auto"):
                log.warning(
                    "VIT_WORKERS=%s is for python -m app; uvicorn app.main:app serves from this one process",
                    settings.workers,
                )
            from app.core.engine.engine import Engine

            configure_tracing()
            engine = await asyncio.to_thread(Engine.load, settings, Metrics())
        except startup_errors() as e:
            code = startup_failed(e)
            logging.shutdown()
            os._exit(code)  # nothing is serving yet: no socket is bound before startup
        serving = Serving(engine, settings, http=None)  # uvicorn serves HTTP
        try:
            await serving.start()
        except OSError as e:
            code = startup_failed(e)
            logging.shutdown()
            os._exit(code)
        engine.start(freeze_heap=True)
        self.app = create_app(engine)
        log.info("ready")
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown: uvicorn has drained HTTP
        await serving.drain()
        shutdown_tracing()
        log.info("stopped")
        await send({"type": "lifespan.shutdown.complete"})
