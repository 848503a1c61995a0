"""Serving processes (VIT_WORKERS > 1): one engine process and N front-ends, started, watched and stopped.

`python -m app` becomes this supervisor when VIT_WORKERS resolves to more than one. It holds the HTTP
and gRPC ports (bound with SO_REUSEPORT, never listening), so a port in use fails the start with exit 3,
then starts:

- the engine process: it loads the models once and answers the front-ends over a ZeroMQ socket
  (`app.workers.engine_host`), batching the images of all of them together;
- N front-end processes, each serving HTTP and gRPC on the shared ports (the kernel spreads the
  connections) over an `EngineClient`, with its own shared-memory arena for images and outputs.

A front-end that dies is started again at once; the others go on serving. An engine that dies is started
again; meanwhile the front-ends answer not-ready and 503. On SIGTERM (or SIGINT) the front-ends turn
not-ready and drain together, then the engine stops; the supervisor exits 0. The children live in
sessions of their own, so a signal to the process group reaches the supervisor only, and each stops
by itself if the supervisor dies.

The engine is started afresh (spawned: no CUDA or thread state inherited). Front-ends are forked from a
fork server that has imported the serving stack once (`app.workers.fork_server`), so one that died serves again
within a fraction of a second rather than after importing torch again.

Every process writes its metrics into PROMETHEUS_MULTIPROC_DIR under the run directory; `/metrics` on
any front-end sums them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from typing import Any

import torch
from prometheus_client import multiprocess

from app.listen import cannot_listen
from app.settings import Settings
from app.startup import STARTUP_FAILED_EXIT_CODE, startup_errors, startup_failed
from app.telemetry.logs import configure_logging
from app.telemetry.metrics import Metrics
from app.telemetry.tracing import configure_tracing, shutdown_tracing
from app.workers.arena import Arena
from app.workers.engine_client import EngineClient
from app.workers.front_end import serve_front_end

log = logging.getLogger("app")
RESTART_BACKOFF_S = 1.0  # a process that dies within this of its start waits this long to start again
ENGINE_START_TIMEOUT_S = 600.0  # loading, exporting and warming every model


def arena_bytes(settings: Settings) -> int:
    """A front-end's shared memory: room for several of the largest requests in flight at once."""
    return min(max(4 * settings.max_upload_bytes, 16 * 2**20), 256 * 2**20)


def run_directory() -> Path:
    """Where the engine's socket, the arenas and the metrics files live: a memory file system when there is one."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="vit-serve-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))


def hold_port(host: str, port: int) -> socket.socket:
    """`port` bound (not listening) with SO_REUSEPORT: taken from any other program, shared with the front-ends."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def hold_ports(host: str, port: int, settings: Settings) -> list[socket.socket]:
    held = []
    try:
        try:
            held.append(hold_port(host, port))
        except OSError as e:
            raise cannot_listen(host, port, e) from None
        if settings.grpc_port:
            try:
                held.append(hold_port("::", settings.grpc_port))
            except OSError as e:
                raise OSError(
                    f"VIT_GRPC_PORT {settings.grpc_port}: cannot listen ({e.strerror or e}); free the port, or set 0 "
                    "to turn gRPC off"
                ) from None
    except OSError:
        for sock in held:
            sock.close()
        raise
    return held


@dataclass(eq=False)
class Child:
    role: str  # "engine" or "front-end N"
    process: BaseProcess
    started_at: float


class Supervisor:
    """The engine process and `workers` front-ends serving HTTP on host:port and gRPC on VIT_GRPC_PORT."""

    def __init__(self, host: str, port: int, settings: Settings, workers: int) -> None:
        self.host = host
        self.port = port
        self.settings = settings
        self.workers = workers
        self.spawn = multiprocessing.get_context("spawn")  # the engine: no CUDA or thread state inherited
        self.fork = multiprocessing.get_context("forkserver")  # the front-ends (see the module's note)
        self.fork.set_forkserver_preload(["app.workers.fork_server"])
        self.directory = run_directory()
        self.address = f"ipc://{self.directory / 'engine.sock'}"
        self.engine: Child | None = None
        self.engine_loaded: ProcessEvent | None = None
        self.front_ends: dict[int, Child] = {}
        self.generation = 0
        self.exit_code = 0

    async def run(self, stop: asyncio.Event) -> int:
        metrics_dir = self.directory / "metrics"
        metrics_dir.mkdir()
        (self.directory / "regions").mkdir()  # the shared-memory regions clients register, seen by every front-end
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # read by every child as it starts
        try:
            held = hold_ports(self.host, self.port, self.settings)
        except OSError as e:
            shutil.rmtree(self.directory, ignore_errors=True)
            return startup_failed(e)
        self.port = held[0].getsockname()[1]  # the one the system chose where --port 0 asked it to: the front-ends'
        try:
            return await self.supervise(stop)
        finally:
            for sock in held:
                sock.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    async def supervise(self, stop: asyncio.Event) -> int:
        self.start_engine()
        for slot in range(self.workers):  # listening at once: not ready (503) while the engine loads the models
            self.start_front_end(slot, listen_at_once=True)
        if not await self.engine_loads(stop):
            await self.shut_down()
            return 0 if stop.is_set() else STARTUP_FAILED_EXIT_CODE
        log.info(
            "started %d front-end processes (HTTP on %s:%d, gRPC %s) over the engine process (pid %s)",
            self.workers,
            self.host,
            self.port,
            f"on port {self.settings.grpc_port}" if self.settings.grpc_port else "off",
            self.engine.process.pid if self.engine else "?",
        )
        while not stop.is_set() and self.exit_code == 0:
            await self.wait_any(stop)
            await self.restart_the_dead()
        await self.shut_down()
        return self.exit_code

    def start_engine(self) -> None:
        """The engine process started (it loads the models, then serves the front-ends)."""
        loaded = self.spawn.Event()
        process = self.spawn.Process(
            target=engine_main,
            args=(self.settings, self.address, loaded, os.getpid(), self.workers),
            name="vit-engine",
            daemon=False,
        )
        process.start()
        self.engine = Child("engine", process, time.monotonic())
        self.engine_loaded = loaded  # held: the child opens it while it starts

    async def engine_loads(self, stop: asyncio.Event) -> bool:
        """True once the engine first started is serving; False if it failed (or `stop` was set first)."""
        assert self.engine is not None and self.engine_loaded is not None
        process, loaded = self.engine.process, self.engine_loaded
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while not loaded.is_set():
            if stop.is_set():
                return False
            if not process.is_alive() or time.monotonic() > deadline:
                process.join(1)
                if process.is_alive():
                    process.kill()
                return False
            await asyncio.sleep(0.05)
        return True

    def start_front_end(self, slot: int, listen_at_once: bool = False) -> None:
        """Front-end `slot` started: listening at once at the service's start, otherwise (a restart) once the
        engine has answered, so that it does not answer not-ready beside front-ends that are ready."""
        self.generation += 1
        arena = self.directory / f"front-end-{slot}-{self.generation}.shm"
        plan = FrontEndPlan(
            self.host,
            self.port,
            self.settings,
            self.address,
            arena,
            arena_bytes(self.settings),
            self.directory / "regions",
            os.getpid(),
            listen_at_once,
        )
        process = self.fork.Process(
            target=front_end_main,
            args=(plan,),
            name=f"vit-front-end-{slot}",
            daemon=False,
        )
        process.start()
        self.front_ends[slot] = Child(f"front-end {slot}", process, time.monotonic())

    def children(self) -> list[Child]:
        return ([self.engine] if self.engine else []) + list(self.front_ends.values())

    async def wait_any(self, stop: asyncio.Event) -> None:
        """Until a child exits or `stop` is set."""
        loop = asyncio.get_running_loop()
        woke = asyncio.Event()
        sentinels = [c.process.sentinel for c in self.children()]
        for fd in sentinels:
            loop.add_reader(fd, woke.set)
        try:
            stopped = asyncio.create_task(stop.wait())
            exited = asyncio.create_task(woke.wait())
            await asyncio.wait([stopped, exited], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            exited.cancel()
        finally:
            for fd in sentinels:
                loop.remove_reader(fd)

    async def restart_the_dead(self) -> None:
        for child in self.children():
            process = child.process
            if process.is_alive():
                continue
            process.join()
            code = process.exitcode
            multiprocess.mark_process_dead(process.pid)
            if code == STARTUP_FAILED_EXIT_CODE:  # a setting or a port that no restart can fix
                log.critical("%s could not start (exit %d): stopping", child.role, code)
                self.exit_code = STARTUP_FAILED_EXIT_CODE
                return
            log.error("%s (pid %s) exited with %s: starting it again", child.role, process.pid, describe_exit(code))
            if time.monotonic() - child.started_at < RESTART_BACKOFF_S:
                await asyncio.sleep(RESTART_BACKOFF_S)
            if child is self.engine:
                self.start_engine()
            else:
                slot = next(s for s, c in self.front_ends.items() if c is child)
                for stale in self.directory.glob(f"front-end-{slot}-*.shm"):
                    stale.unlink(missing_ok=True)
                self.start_front_end(slot)

    async def shut_down(self) -> None:
        """The front-ends drain together (VIT_DRAIN_TIMEOUT_S), then the engine stops."""
        grace = self.settings.drain_timeout_s + 5
        log.info("stopping: %d front-ends drain, then the engine", len(self.front_ends))
        await stop_all([c.process for c in self.front_ends.values()], grace)
        if self.engine is not None:
            await stop_all([self.engine.process], grace)
        for child in self.children():
            with contextlib.suppress(Exception):
                multiprocess.mark_process_dead(child.process.pid)
        log.info("stopped")


async def stop_all(processes: list[BaseProcess], grace_s: float) -> None:
    """SIGTERM to each process, SIGKILL to those still running after `grace_s`."""
    for p in processes:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for p in processes:
        if p.is_alive():
            log.warning("%s did not stop within %.0f s: killed", p.name, grace_s)
            p.kill()
        p.join()


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


# The children.
def become_child(supervisor: int) -> asyncio.Event:
    """A session of its own (a signal to the supervisor's process group is not for it), SIGTERM as the
    only way to stop it, and a stop of its own when the supervisor (pid `supervisor`, the parent of the
    engine, the grandparent of a front-end) dies. Run on the child's event loop."""
    os.setsid()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        pidfd = os.pidfd_open(supervisor)
        loop.add_reader(pidfd, stop.set)
    except ProcessLookupError:  # gone already
        stop.set()
    except (AttributeError, OSError):  # no pidfd: look every second

        async def watch() -> None:
            while alive(supervisor):
                await asyncio.sleep(1)
            stop.set()

        watching.add(loop.create_task(watch()))
    return stop


watching: set[asyncio.Task[None]] = set()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_child(main: Coroutine[Any, Any, int]) -> None:
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        code = runner.run(main)
    logging.shutdown()
    os._exit(code)


def engine_main(settings: Settings, address: str, loaded: ProcessEvent, supervisor: int, front_ends: int) -> None:
    run_child(serve_engine(settings, address, loaded, supervisor, front_ends))


async def serve_engine(settings: Settings, address: str, loaded: ProcessEvent, supervisor: int, front_ends: int) -> int:
    stop = become_child(supervisor)
    configure_logging(settings.log_level, settings.log_format)
    # imported here: the front-end processes, forked from a server that imports this module, never load the
    # engine's backends
    from app.core.engine.engine import Engine
    from app.workers.engine_host import EngineHost

    try:
        configure_tracing()  # with OTEL_EXPORTER_OTLP_ENDPOINT set: the engine's spans
        engine = await asyncio.to_thread(Engine.load, settings, Metrics())
    except startup_errors() as e:
        return startup_failed(e)
    engine.start(freeze_heap=True)
    host = EngineHost(engine, address, front_ends)
    serving = asyncio.create_task(host.serve(stop))
    await asyncio.sleep(0)  # bound before the supervisor hears it is up
    loaded.set()
    log.info("engine (pid %d) serving %s", os.getpid(), ", ".join(m.name for m in engine.models()))
    await serving
    await engine.shutdown()
    host.close()
    shutdown_tracing()
    return 0


@dataclass(frozen=True)
class FrontEndPlan:
    """What a front-end process is started with."""

    host: str
    port: int
    settings: Settings
    address: str  # the engine's ZeroMQ address
    arena_path: Path
    arena_size: int
    regions: Path  # the folder of the shared-memory regions clients register
    supervisor: int  # the supervisor's pid, watched
    listen_at_once: bool  # before the engine answers (the service's start), or only once it has (a restart)


def front_end_main(plan: FrontEndPlan) -> None:
    run_child(serve_through_engine(plan))


async def serve_through_engine(plan: FrontEndPlan) -> int:
    host, port, settings = plan.host, plan.port, plan.settings
    stop = become_child(plan.supervisor)
    configure_logging(settings.log_level, settings.log_format)
    # Each image is preprocessed on one core: a front-end's requests run side by side on its pool, and
    # N front-ends side by side, where torch's default would start a thread per core inside each resize.
    torch.set_num_threads(1)
    try:
        arena: Arena | None = Arena.create(plan.arena_path, plan.arena_size)
    except OSError as e:
        log.warning("%s: images go to the engine inside its messages instead", e)
        arena = None
    try:
        configure_tracing()
    except ValueError as e:
        return startup_failed(e)
    plane = EngineClient(settings, Metrics(), plan.address, arena, plan.regions)
    return await serve_front_end(host, port, settings, plane, stop, plan.listen_at_once)
