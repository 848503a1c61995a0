"""Servers as real processes, for the tests and the benchmark: started in their own process group,
output kept in a file, ready when an endpoint answers 200, stopped with the whole group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.cpu import process_cpu_s
from harness.preloaded import start_command

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int, besides: int | None = None) -> list[int]:
    """`count` ports free now, each a different one and none `besides`: all held at once while they are chosen
    (ports taken one after another may come back the same, the first released before the next is asked for)."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) != besides:
                ports.append(port)
        return ports


class ServerProcess:
    """`argv` started from `cwd` with `env` over this process's environment, listening on `port`.

    With `preloaded` set (the test suite sets it), `python -m app` of this checkout is forked from a process that
    has imported it already (`harness.preloaded`) wherever its environment allows: the same server, without
    the interpreter's imports each time. Benchmarks leave it unset: a start's own cost is part of what they
    measure.
    """

    preloaded = False

    def __init__(
        self, argv: list[str], env: dict[str, str], port: int, ready_path: str = "/health/ready", cwd: Path = ROOT
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        # Output goes to a file, not a pipe: an unread pipe fills up and blocks the server's logging.
        self.output = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.final_output = ""
        # its own process group: a server's workers are its children
        self.proc = start_command(argv, self.output, self.output, {**os.environ, **env}, cwd, fork=self.preloaded)

    def __enter__(self) -> ServerProcess:
        """Started and ready; stopped (with its whole process group) when the block ends."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def cpu_seconds(self) -> float:
        """The CPU time (user + system) the server's processes have used so far."""
        return process_cpu_s(self.proc.pid)

    def read_output(self) -> str:
        if self.output.closed:
            return self.final_output
        self.output.seek(0)
        return self.output.read()

    def accepted(self, protocol: str, route: str) -> float:
        """Requests of `protocol` ("http" or "grpc") to `route` (a path, or an RPC) that the server has taken:
        answered or in flight, from /metrics (summed over every serving process)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            if family.name in ("vit_requests", "vit_requests_in_flight")
            for sample in family.samples
            if sample.name in ("vit_requests_total", "vit_requests_in_flight")
            and sample.labels.get("protocol") == protocol
            and sample.labels.get("route") == route
        )

    async def until_accepted(self, protocol: str, route: str, count: float, timeout: float = 60) -> None:
        """Wait (without blocking the event loop that sends them) until the server has taken `count` requests
        of `protocol` to `route`."""
        deadline = time.monotonic() + timeout
        while (taken := await asyncio.to_thread(self.accepted, protocol, route)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server took {taken:.0f} of {count:.0f} {protocol} requests to {route}")
            await asyncio.sleep(0.02)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.read_output()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server did not become ready:\n{self.read_output()[-4000:]}")

    def stop(self) -> str:
        """SIGTERM, then SIGKILL to the whole group (no worker may outlive it); returns everything it wrote.
        Stopping again only returns that output."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if not self.output.closed:
            self.final_output = self.read_output()
            self.output.close()
        return self.final_output


class Server(ServerProcess):
    """This service as `python -m app` runs it, serving `checkpoint` on the CPU unless `env` says otherwise;
    gRPC on a free port of its own (`grpc_target`) unless VIT_GRPC_PORT says otherwise.

    `with Server(checkpoint, VIT_MAX_FILES="8") as server:` waits until it is ready and stops it afterwards.
    `tree` serves the code of another checkout instead (a benchmark's before and after).
    """

    def __init__(self, checkpoint: Path, port: int | None = None, *, tree: Path = ROOT, **env: str) -> None:
        if not port:
            port, grpc_port = free_ports(2)
        else:
            [grpc_port] = free_ports(1, besides=port)
        argv = [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port)]
        env.setdefault("VIT_GRPC_PORT", str(grpc_port))
        env.setdefault("VIT_DRAIN_TIMEOUT_S", "20")
        if tree != ROOT:
            env.setdefault("PYTHONPATH", str(tree))
        self.grpc_target = f"127.0.0.1:{env['VIT_GRPC_PORT']}"
        super().__init__(argv, {"VIT_WEIGHTS": str(checkpoint), "VIT_DEVICE": "cpu", **env}, port, cwd=tree)

    def __enter__(self) -> Server:
        super().__enter__()
        return self
