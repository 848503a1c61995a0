"""One serving lifecycle: HTTP (uvicorn) and gRPC over one data plane, bound, started, and drained together.

Every process that serves uses it: `python -m app` (one process), each serving front-end (VIT_WORKERS > 1)
and the lifespan of `uvicorn app.main:app`, where uvicorn owns HTTP and this serves only gRPC.

    serving = Serving(plane, settings, http=("0.0.0.0", 8000))
    await serving.start()       # binds HTTP and starts gRPC: OSError (with what to fix) when a port is taken
    code = await serving.run(stop)  # serves until `stop`, then drains: the exit code

Draining: the plane turns unready for every protocol at once; the HTTP listener closes and gRPC takes no
new calls; both answer what they accepted, together, within VIT_DRAIN_TIMEOUT_S; then the plane answers
what is left within the rest of that time and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Iterator

import uvicorn

from app.core.data_plane import DataPlane
from app.grpc.server import GrpcServer
from app.settings import Settings
from app.telemetry.logs import uvicorn_log_config
from app.web.app import create_app

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
        raise cannot_listen(host, port, e) from None
    sock.set_inheritable(True)
    return sock


def cannot_listen(host: str, port: int, e: OSError) -> OSError:
    """What to fix where HTTP cannot bind `host`:`port`: the host (no such name, or no address of this machine),
    or the port."""
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return OSError(f"HTTP host {host}: not an address of this machine ({e.strerror or e}); pass another --host")
    return OSError(f"HTTP port {host}:{port}: cannot listen ({e.strerror or e}); free the port or pass --port")


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


class Serving:
    """HTTP on `http` (host, port; None: someone else serves HTTP) and gRPC on VIT_GRPC_PORT over `plane`;
    with `reuse_port`, on ports shared with the other serving front-ends."""

    def __init__(
        self, plane: DataPlane, settings: Settings, http: tuple[str, int] | None, reuse_port: bool = False
    ) -> None:
        self.plane = plane
        self.settings = settings
        self.http_address = http
        self.reuse_port = reuse_port
        self.sock: socket.socket | None = None
        self.grpc: GrpcServer | None = None

    async def start(self) -> None:
        """Bind HTTP, start gRPC. A port that cannot be taken: what was opened is closed, the plane shut down,
        and OSError raised, saying what to fix."""
        try:
            if self.http_address is not None:
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
        http = http_server(self.plane, self.settings)
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

    async def drain(self, http: HttpServer | None = None, serving: asyncio.Task[None] | None = None) -> None:
        """Unready at once; HTTP (when served here) and gRPC closed to new work and drained together; then the
        plane answers what is left within the rest of VIT_DRAIN_TIMEOUT_S and stops."""
        loop = asyncio.get_running_loop()
        timeout_s = self.settings.drain_timeout_s
        deadline = loop.time() + timeout_s
        self.plane.begin_drain()  # /health/ready, /v2/health/ready and ServerReady answer not-ready from here
        if http is not None:
            http.should_exit = True
        log.info("draining: HTTP and gRPC answer what they accepted (up to %.0f s)", timeout_s)
        await asyncio.gather(
            serving or asyncio.sleep(0),
            self.grpc.stop(timeout_s) if self.grpc else asyncio.sleep(0),
            return_exceptions=True,
        )
        await self.plane.shutdown(max(0.0, deadline - loop.time()))
