"""Load a server with `hey` (a compiled HTTP load generator) and read the results."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LoadResult:
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    ok: int
    errors: int  # non-200 answers and transport errors
    mean_batch_size: float | None


def require_hey() -> str:
    hey = shutil.which("hey")
    if hey is None:
        raise SystemExit("the benchmark needs the `hey` load generator: apt-get install hey (Debian/Ubuntu)")
    return hey


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    """A server started as its own process, ready when `ready_path` answers 200."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, ready_path: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(ROOT / "bench" / "results" / f"server-{port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(  # its own process group: LitServe's workers are its children
            argv, cwd=ROOT, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early; see {self.log.name}")
            try:
                if httpx.get(self.url + ready_path, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready; see {self.log.name}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole group: no worker may outlive the server and load the next run."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def start_service(weights: Path, max_batch_size: int, wait_ms: float, threads: int, backend: str) -> ServerProcess:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "app.main:app",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    env = {
        "VIT_WEIGHTS": str(weights), "VIT_DEVICE": "auto", "VIT_MAX_BATCH_SIZE": str(max_batch_size),
        "VIT_MAX_WAIT_MS": str(wait_ms), "VIT_MAX_QUEUE": "4096", "VIT_THREADS": str(threads), "VIT_LOG_LEVEL": "warning",
        "VIT_BACKEND": backend,
    }  # fmt: skip
    return ServerProcess(argv, env, port, "/health/ready")


def start_litserve(weights: Path, max_batch_size: int, wait_ms: float, threads: int, backend: str) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "bench.litserve_server", "--weights", str(weights), "--port", str(port),
            "--max-batch-size", str(max_batch_size), "--wait-ms", str(wait_ms), "--threads", str(threads),
            "--backend", backend]  # fmt: skip
    return ServerProcess(argv, {}, port, "/health")


def batch_counters(url: str) -> tuple[float, float] | None:
    """(images, batches) from the service's /metrics; None for servers without them."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    # summed over the served models (their series carry a model label)
    images = re.findall(r"^vit_batch_size_sum(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    batches = re.findall(r"^vit_batch_size_count(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    return (sum(map(float, images)), sum(map(float, batches))) if images and batches else None


def run_hey(url: str, body: Path, content_type: str, concurrency: int, seconds: float) -> LoadResult:
    """POST `body` for `seconds` from `concurrency` workers; the mean batch size comes from /metrics."""
    base = url.rsplit("/", 1)[0]
    before = batch_counters(base)
    out = subprocess.run(
        [require_hey(), "-z", f"{seconds}s", "-c", str(concurrency), "-m", "POST", "-T", content_type, "-D", str(body), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    after = batch_counters(base)
    mean_batch = None
    if before and after and after[1] > before[1]:
        mean_batch = (after[0] - before[0]) / (after[1] - before[1])
    return parse_hey(out, concurrency, mean_batch)


def parse_hey(out: str, concurrency: int, mean_batch: float | None) -> LoadResult:
    def pct(p: int) -> float:
        m = re.search(rf"{p}% in (\S+) secs", out)
        return float(m.group(1)) * 1e3 if m else float("nan")

    rps = re.search(r"Requests/sec:\s+(\S+)", out)
    statuses = {int(code): int(n) for code, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", out)}
    transport_errors = (
        sum(int(n) for n in re.findall(r"^\s+\[(\d+)\]\s+\S", out.split("Error distribution:")[-1], re.MULTILINE))
        if "Error distribution:" in out
        else 0
    )
    ok = statuses.get(200, 0)
    return LoadResult(
        concurrency=concurrency,
        requests_per_s=float(rps.group(1)) if rps else 0.0,
        p50_ms=pct(50), p90_ms=pct(90), p99_ms=pct(99),
        ok=ok,
        errors=sum(statuses.values()) - ok + transport_errors,
        mean_batch_size=mean_batch,
    )  # fmt: skip
