"""One serving lifecycle: HTTP (uvicorn) and gRPC over one data plane, bound, started, and drained together.

Every process that serves uses it: `python -m app` (one process), each serving front-end (VIT_WORKERS > 1)
and the lifespan of `uvicorn app.main:app`, where uvicorn owns HTTP and this serves only gRPC.

    serving = Serving(LoadingPlane(settings, metrics), settings, http=("0.0.0.0", 8000))
    await serving.start()       # binds HTTP and starts gRPC: OSError (with what to fix) when a port is taken
    running = asyncio.create_task(serving.run(stop))  # serves until `stop`, then drains: the exit code
    serving.hand_over(engine)   # once the models are loaded: ready

Draining, with every listener still up: the plane turns unready for every protocol at once, and requests that
arrive are answered 503 `draining` (UNAVAILABLE over gRPC) while those accepted before are answered, within
VIT_DRAIN_TIMEOUT_S; any still running then are answered 503 `draining: not finished within
VIT_DRAIN_TIMEOUT_S`. Then the HTTP listener closes, gRPC stops, and the plane stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from app.core.data_plane import DataPlane
from app.grpc.server import GrpcServer
from app.listen import bind_http
from app.settings import Settings
from app.telemetry.logs import uvicorn_log_config
from app.web.app import create_app

log = logging.getLogger("app")
CUT_ANSWERS_S = 1.0  # for the answers to requests the drain's end cut short, and to close the listeners


def check_ports(port: int, settings: Settings) -> None:
    """ValueError where gRPC would listen on the HTTP port: each protocol needs a port of its own (bound to the
    same number, the two listeners would split the connections between them, each refusing the other's)."""
    if settings.grpc_port and settings.grpc_port == port:
        raise ValueError(
            f"VIT_GRPC_PORT {port} is the HTTP port too: give gRPC another port (or 0: off), or pass another --port"
        )


class HttpServer(uvicorn.Server):
    """uvicorn's server, leaving signals to the process's owner, which tells it when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(app: FastAPI, settings: Settings) -> HttpServer:
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level=settings.log_level,
        log_config=uvicorn_log_config(settings.log_format) or uvicorn.config.LOGGING_CONFIG,
        access_log=False,  # app.access writes each request's line, with its duration, ID and client
        timeout_graceful_shutdown=max(1, round(settings.drain_timeout_s)),
    )
    return HttpServer(config)


class Serving:
    """HTTP on `http` (host, port; None: someone else serves HTTP, `app`) and gRPC on VIT_GRPC_PORT over `plane`;
    with `reuse_port`, on ports shared with the other serving front-ends; on `listening` where HTTP's socket is
    bound already."""

    def __init__(
        self,
        plane: DataPlane,
        settings: Settings,
        http: tuple[str, int] | None,
        reuse_port: bool = False,
        listening: socket.socket | None = None,
    ) -> None:
        self.plane = plane
        self.settings = settings
        self.http_address = http
        self.reuse_port = reuse_port
        self.app = create_app(plane)
        self.sock = listening  # HTTP's socket, when bound already (app.listen.listen_early)
        self.grpc: GrpcServer | None = None
        self.answering: asyncio.Task[None] | None = None  # the drain's first step, once begun
        self.deadline = 0.0  # when the drain's time runs out, once begun
        self.retired: asyncio.Task[None] | None = None  # the first plane's shutdown, once handed over

    async def start(self) -> None:
        """Bind HTTP, start gRPC. A port that cannot be taken: what was opened is closed, the plane shut down,
        and OSError raised, saying what to fix."""
        try:
            if self.http_address is not None and self.sock is None:
                self.sock = bind_http(*self.http_address, reuse_port=self.reuse_port)
            if self.settings.grpc_port:
                limit = self.settings.grpc_message_limit()
                self.grpc = GrpcServer(self.plane, self.settings.grpc_port, limit, reuse_port=self.reuse_port)
                await self.grpc.start()
        except OSError:
            if self.sock is not None:
                self.sock.close()
            await self.plane.shutdown(0)
            raise

    def hand_over(self, plane: DataPlane) -> None:
        """Every protocol serves `plane` (sharing the first plane's metrics) from its next request on: the engine,
        once the models are loaded, in place of the `LoadingPlane` that answered until then. The first plane is
        shut down."""
        loading, self.plane = self.plane, plane
        if self.answering is not None:  # a drain under way goes on over the new plane: never ready
            plane.begin_drain()
        self.app.state.data_plane = plane
        if self.grpc is not None:
            self.grpc.hand_over(plane)
        self.retired = asyncio.get_running_loop().create_task(loading.shutdown(0))

    @property
    def http_port(self) -> int:
        """The port HTTP is bound to: the one asked for, or the one the system chose for port 0."""
        assert self.sock is not None, "start() binds HTTP"
        port: int = self.sock.getsockname()[1]
        return port

    async def run(self, stop: asyncio.Event) -> int:
        """Serve HTTP and gRPC until `stop` is set (or HTTP fails), then drain both and the plane; the exit
        code: 1 when HTTP failed by itself, 0 otherwise."""
        assert self.sock is not None, "run() serves HTTP: start() binds it"
        http = http_server(self.app, self.settings)
        serving = asyncio.create_task(http.serve(sockets=[self.sock]))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        failed = serving.done() and not serving.cancelled() and serving.exception() is not None
        if failed:  # HTTP stopped by itself: log why, then drain gRPC and the plane all the same
            log.critical("HTTP server failed: %r", serving.exception())
        await self.drain(http, serving)
        self.sock.close()
        return 1 if failed else 0

    async def answer_accepted(self) -> None:
        """The drain's first step, with every listener still up: not ready at once for every protocol, new requests
        refused (503 `draining`, UNAVAILABLE), and those accepted answered within VIT_DRAIN_TIMEOUT_S; those still
        running then are answered 503 (DRAIN_TIMED_OUT). Calling it again waits for the same step."""
        if self.answering is None:
            self.deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout_s
            self.answering = asyncio.create_task(self.answer_within_drain())
        await self.answering

    async def answer_within_drain(self) -> None:
        timeout_s = self.settings.drain_timeout_s
        self.plane.begin_drain()  # /health/ready, /v2/health/ready and ServerReady answer not-ready from here
        log.info("draining: not ready; HTTP and gRPC answer what they accepted (up to %.0f s)", timeout_s)
        if not await self.plane.settle(self.deadline - asyncio.get_running_loop().time()):
            cut = self.plane.cut()
            log.warning(
                "draining: %d requests not finished within VIT_DRAIN_TIMEOUT_S (%.0f s) answered 503 draining",
                cut,
                timeout_s,
            )
            await self.plane.settle(CUT_ANSWERS_S)  # their answers written before the listeners close
        log.info("drained: the accepted requests answered; the listeners close")

    async def drain(self, http: HttpServer | None = None, serving: asyncio.Task[None] | None = None) -> None:
        """The accepted requests answered with the listeners up (`answer_accepted`); then HTTP (when served here)
        and gRPC closed, and the plane stopped."""
        await self.answer_accepted()
        if http is not None:
            http.should_exit = True
        await asyncio.gather(
            serving or asyncio.sleep(0),
            self.grpc.stop(CUT_ANSWERS_S) if self.grpc else asyncio.sleep(0),
            return_exceptions=True,
        )
        await self.plane.shutdown(max(0.0, self.deadline - asyncio.get_running_loop().time()))
