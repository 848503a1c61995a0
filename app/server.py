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
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import uvicorn

from app.core.data_plane import DataPlane
from app.core.metrics import Metrics
from app.core.remote import RemoteDataPlane
from app.grpc.server import GrpcServer
from app.logs import configure_logging, uvicorn_log_config
from app.settings import Settings
from app.startup import read_settings, startup_errors, startup_failed
from app.tracing import configure_tracing, shutdown_tracing
from app.web.app import create_app
from model.device import resolve_device

if TYPE_CHECKING:  # imported where an engine is built: front-end processes never load its backends
    from app.core.engine import Engine

log = logging.getLogger("app")


def bind_http(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The HTTP listening socket, bound now so that a port in use is an error before serving starts; with
    `reuse_port`, shared with the other serving front-ends (the kernel spreads the connections over them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            f"HTTP port {host}:{port}: cannot listen ({e.strerror or e}); free the port or pass --port"
        ) from None
    sock.set_inheritable(True)
    return sock


class HttpServer(uvicorn.Server):
    """uvicorn's server, leaving signals to the process's owner, which tells it when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(plane: DataPlane, settings: Settings) -> HttpServer:
    config = uvicorn.Config(
        create_app(plane),
        lifespan="off",
        log_level=settings.log_level,
        log_config=uvicorn_log_config(settings.log_format) or uvicorn.config.LOGGING_CONFIG,
        access_log=False,  # app.access writes each request's line, with its duration, ID and client
        timeout_graceful_shutdown=max(1, round(settings.drain_timeout_s)),
    )
    return HttpServer(config)


async def serve(host: str, port: int, settings: Settings | None = None) -> int:
    """Load, serve HTTP on host:port and gRPC on VIT_GRPC_PORT until SIGTERM or SIGINT, drain, stop; the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        settings = settings or read_settings()
        configure_logging(settings.log_level, settings.log_format)
        workers = settings.serving_workers(gpu=await asyncio.to_thread(gpu_serving, settings))
        if workers > 1:
            from app.supervisor import Supervisor  # here: its processes import this module

            return await Supervisor(host, port, settings, workers).run(stop)
        from app.core.engine import Engine

        configure_tracing()  # with OTEL_EXPORTER_OTLP_ENDPOINT set
        engine = await asyncio.to_thread(Engine.load, settings, Metrics())
    except startup_errors() as e:
        return startup_failed(e)
    grpc_server = None
    try:
        sock = bind_http(host, port)
        if settings.grpc_port:
            grpc_server = GrpcServer(engine, settings.grpc_port, settings.grpc_message_limit())
            await grpc_server.start()
    except OSError as e:
        await engine.shutdown(0)
        return startup_failed(e)
    engine.start(freeze_heap=True)
    http = http_server(engine, settings)
    serving = asyncio.create_task(http.serve(sockets=[sock]))
    log.info("ready: HTTP on %s:%d", host, port)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    failed = serving.done() and not serving.cancelled() and serving.exception() is not None
    if failed:  # HTTP stopped by itself: log why, then drain gRPC and the engine all the same
        log.critical("HTTP server failed: %r", serving.exception())
    await drain(engine, http, serving, grpc_server, settings.drain_timeout_s)
    sock.close()
    shutdown_tracing()  # the spans still buffered
    log.info("stopped")
    return 1 if failed else 0


async def drain(
    engine: Engine, http: HttpServer, serving: asyncio.Task[None], grpc_server: GrpcServer | None, timeout_s: float
) -> None:
    """Both protocols not-ready and closed to new work at once, both drained together, then the engine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    engine.begin_drain()  # /health/ready, /v2/health/ready and ServerReady answer not-ready from here
    await drain_edges(http, serving, grpc_server, timeout_s)
    await engine.shutdown(max(0.0, deadline - loop.time()))


async def drain_edges(
    http: HttpServer, serving: asyncio.Task[None], grpc_server: GrpcServer | None, timeout_s: float
) -> None:
    """HTTP and gRPC closed to new work at once and drained together."""
    http.should_exit = True
    log.info("draining: HTTP and gRPC answer what they accepted (up to %.0f s)", timeout_s)
    await asyncio.gather(
        serving, grpc_server.stop(timeout_s) if grpc_server else asyncio.sleep(0), return_exceptions=True
    )


def gpu_serving(settings: Settings) -> bool:
    """Whether the models would be served from a GPU (what VIT_WORKERS=auto goes by)."""
    if settings.workers != "auto" or settings.device == "cpu":
        return False
    try:
        return resolve_device(settings.device).type == "cuda"
    except ValueError:
        return False  # the engine says what is wrong with VIT_DEVICE


async def serve_front_end(host: str, port: int, settings: Settings, plane: RemoteDataPlane, stop: asyncio.Event) -> int:
    """One serving front-end (VIT_WORKERS > 1): HTTP and gRPC on ports it shares with the others, over the
    engine process through `plane`; on `stop`, not ready at once, both protocols drained together."""
    # Listen only once the engine has answered: a front-end listening before would take its share of the
    # connections on the shared ports and answer not-ready while the others answer ready.
    await plane.start()
    while not await plane.wait_engine(0.5):
        if stop.is_set():
            await plane.close()
            return 0
    grpc_server = None
    try:
        sock = bind_http(host, port, reuse_port=True)
        if settings.grpc_port:
            grpc_server = GrpcServer(plane, settings.grpc_port, settings.grpc_message_limit(), reuse_port=True)
            await grpc_server.start()
    except OSError as e:
        await plane.close()
        return startup_failed(e)
    http = http_server(plane, settings)
    serving = asyncio.create_task(http.serve(sockets=[sock]))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    failed = serving.done() and not serving.cancelled() and serving.exception() is not None
    if failed:
        log.critical("HTTP server failed: %r", serving.exception())
    plane.begin_drain()
    await drain_edges(http, serving, grpc_server, settings.drain_timeout_s)
    await plane.close()
    sock.close()
    shutdown_tracing()
    return 1 if failed else 0


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
            from app.core.engine import Engine

            configure_tracing()
            engine = await asyncio.to_thread(Engine.load, settings, Metrics())
        except startup_errors() as e:
            code = startup_failed(e)
            logging.shutdown()
            os._exit(code)  # nothing is serving yet: no socket is bound before startup
        grpc_server = None
        try:
            if settings.grpc_port:
                grpc_server = GrpcServer(engine, settings.grpc_port, settings.grpc_message_limit())
                await grpc_server.start()
        except OSError as e:
            await engine.shutdown(0)
            code = startup_failed(e)
            logging.shutdown()
            os._exit(code)
        engine.start(freeze_heap=True)
        self.app = create_app(engine)
        log.info("ready")
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown: uvicorn has drained HTTP
        engine.begin_drain()
        if grpc_server is not None:
            await grpc_server.stop(settings.drain_timeout_s)
        await engine.shutdown()
        shutdown_tracing()
        log.info("stopped")
        await send({"type": "lifespan.shutdown.complete"})
