"""The process's owner: the engine loaded once, HTTP (uvicorn) and gRPC served side by side, one joint drain.

`python -m app` runs `serve`. Both protocols listen before the models load, answering not-ready (503,
UNAVAILABLE) until they are loaded and warm. On SIGTERM (or SIGINT) both turn not-ready at the same moment and
refuse new requests (503 `draining`) while they answer those accepted, within VIT_DRAIN_TIMEOUT_S; then the
listeners close and the engine stops. A bad setting or checkpoint, or a port that cannot be bound, ends the
process with one log line and exit code 3 after shutting down whatever was loaded.

`uvicorn app.main:app` runs `LifespanApp` instead: the same loading, engine, gRPC server and drain, started and
stopped by uvicorn's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from types import FrameType
from typing import Any, NoReturn

from app.core.loading_plane import LoadingPlane
from app.serving import Serving, check_ports
from app.settings import Settings
from app.startup import read_settings, startup_errors, startup_failed
from app.telemetry.logs import configure_logging
from app.telemetry.metrics import Metrics
from app.telemetry.tracing import configure_tracing, shutdown_tracing
from app.workers.supervisor import Supervisor
from model.device import resolve_device

log = logging.getLogger("app")


async def serve(host: str, port: int, settings: Settings | None = None, listening: socket.socket | None = None) -> int:
    """Listen on host:port (HTTP) and VIT_GRPC_PORT (gRPC), load the models meanwhile (not ready until then),
    serve until SIGTERM or SIGINT, drain, stop; the exit code. `listening`: HTTP's socket, listening already
    (`app.listen.listen_early`)."""
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
            if listening is not None:  # serving processes after all (a GPU found): their front-ends listen
                listening.close()
            return await Supervisor(host, port, settings, workers).run(stop)
        from app.core.engine.engine import Engine  # here: the supervisor's process never loads the backends

        configure_tracing()  # with OTEL_EXPORTER_OTLP_ENDPOINT set
    except startup_errors() as e:
        return startup_failed(e)
    metrics = Metrics()
    serving = Serving(LoadingPlane(settings, metrics), settings, http=(host, port), listening=listening)
    try:
        await serving.start()
    except OSError as e:
        return startup_failed(e)
    log.info("listening: HTTP on %s:%d; not ready while the models load", host, serving.http_port)
    running = asyncio.create_task(serving.run(stop))
    loading = asyncio.create_task(asyncio.to_thread(Engine.load, settings, metrics))
    await asyncio.wait([running, loading], return_when=asyncio.FIRST_COMPLETED)
    stopped = stop.is_set() or running.done()
    if stopped or not loading.done():  # stopped (or HTTP failed) while the models loaded: drained, the load let finish
        code = await running
        with contextlib.suppress(*startup_errors()):
            await (await loading).shutdown(0)
        log.info("stopped")
        return code
    if (failed := loading.exception()) is not None:  # said first, then the listeners close
        exit_code = startup_failed(failed) if isinstance(failed, startup_errors()) else None
        stop.set()
        await running
        if exit_code is None:
            raise failed
        return exit_code
    engine = loading.result()
    serving.hand_over(engine)
    engine.start(freeze_heap=True)
    log.info("ready: HTTP on %s:%d", host, serving.http_port)
    code = await running
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
SignalHandler = Callable[[int, FrameType | None], Any]


class LifespanApp:
    """`uvicorn app.main:app`: an ASGI app whose lifespan starts gRPC and serves `create_app` over a `LoadingPlane`
    at once (uvicorn listens only once the lifespan has started), loads the engine meanwhile and hands it over. On
    SIGTERM (or SIGINT) it answers what was accepted with the listeners up, then lets uvicorn stop; the lifespan's
    shutdown stops gRPC and the engine."""

    def __init__(self) -> None:
        self.app: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None
        self.serving: Serving | None = None
        self.tasks: set[asyncio.Task[None]] = set()

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
            configure_tracing()
        except startup_errors() as e:
            self.exit(startup_failed(e))
        metrics = Metrics()
        self.serving = serving = Serving(LoadingPlane(settings, metrics), settings, http=None)  # uvicorn serves HTTP
        try:
            await serving.start()
        except OSError as e:
            self.exit(startup_failed(e))
        self.app = serving.app
        self.start_task(self.load(serving, settings, metrics))
        self.drain_before_uvicorn_stops(serving)
        log.info("listening; not ready while the models load")
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown: uvicorn has closed HTTP
        await serving.drain()
        shutdown_tracing()
        log.info("stopped")
        await send({"type": "lifespan.shutdown.complete"})

    async def load(self, serving: Serving, settings: Settings, metrics: Metrics) -> None:
        from app.core.engine.engine import Engine

        try:
            engine = await asyncio.to_thread(Engine.load, settings, metrics)
        except startup_errors() as e:
            self.exit(startup_failed(e))
        if serving.answering is not None:  # a drain began while the models loaded: never served
            await engine.shutdown(0)
            return
        serving.hand_over(engine)
        engine.start(freeze_heap=True)
        log.info("ready")

    def drain_before_uvicorn_stops(self, serving: Serving) -> None:
        """SIGTERM and SIGINT first answer what was accepted, with uvicorn's listener still up (its own handling
        closes it at once), then go on to the handler uvicorn installed, which stops it. Chained through the
        `signal` module's handlers, where uvicorn installs its own (in the main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            then = signal.getsignal(sig)
            if not callable(then):
                continue

            def drain_first(signum: int, frame: FrameType | None, then: SignalHandler = then) -> None:
                if serving.answering is not None:  # again (a second Ctrl-C): straight to uvicorn
                    then(signum, frame)
                    return
                loop.call_soon_threadsafe(self.start_task, self.drain_then(serving, then, signum))

            signal.signal(sig, drain_first)

    async def drain_then(self, serving: Serving, then: SignalHandler, signum: int) -> None:
        await serving.answer_accepted()
        then(signum, None)

    def start_task(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @staticmethod
    def exit(code: int) -> NoReturn:
        logging.shutdown()
        os._exit(code)  # uvicorn's lifespan would otherwise wait, or serve without models
