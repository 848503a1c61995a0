"""Load a server with `hey` (a compiled HTTP load generator) and read the results."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.server import Server, ServerProcess, free_port


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
    statuses: dict[int, int] = field(default_factory=dict)  # HTTP status -> answers


def require_hey() -> str:
    hey = shutil.which("hey")
    if hey is None:
        raise SystemExit("the benchmark needs the `hey` load generator: apt-get install hey (Debian/Ubuntu)")
    return hey


def start_service(weights: Path, max_batch_size: int, wait_ms: float, threads: int, backend: str) -> ServerProcess:
    server = Server(
        weights,
        VIT_DEVICE="auto",
        VIT_MAX_BATCH_SIZE=str(max_batch_size),
        VIT_MAX_WAIT_MS=str(wait_ms),
        VIT_MAX_QUEUE="4096",
        VIT_THREADS=str(threads),
        VIT_LOG_LEVEL="warning",
        VIT_BACKEND=backend,
    )
    server.wait_ready(180)
    return server


def start_litserve(
    weights: Path,
    max_batch_size: int,
    wait_ms: float,
    threads: int,
    backend: str,
    api_servers: int = 1,
    workers_per_device: int = 1,
    decode: str = "cpu",
) -> ServerProcess:
    """LitServe (bench.peers.litserve_server) serving `weights`: its API servers, inference workers and decoding as given."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "bench.peers.litserve_server",
        "--weights",
        str(weights),
        "--port",
        str(port),
        "--max-batch-size",
        str(max_batch_size),
        "--wait-ms",
        str(wait_ms),
        "--threads",
        str(threads),
        "--backend",
        backend,
        "--api-servers",
        str(api_servers),
        "--workers-per-device",
        str(workers_per_device),
        "--decode",
        decode,
    ]
    server = ServerProcess(argv, {}, port, "/health")
    server.wait_ready(180)
    return server


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


def v2_body(files: list[bytes]) -> tuple[bytes, dict[str, str]]:
    """A V2 binary request of image `files` (the input `image`, BYTES, each file after its 4-byte length; the
    probabilities asked for in binary), and the header that says where its JSON ends."""
    binary = b"".join(len(f).to_bytes(4, "little") + f for f in files)
    image = {
        "name": "image",
        "datatype": "BYTES",
        "shape": [len(files)],
        "parameters": {"binary_data_size": len(binary)},
    }
    header = {"inputs": [image], "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}]}
    head = json.dumps(header).encode()
    return head + binary, {"Inference-Header-Content-Length": str(len(head))}


def cpu_decode_share(url: str) -> float | None:
    """The share of the first model's plain JPEGs decoded on the host's cores now (`vit_cpu_decode_share` in
    /metrics), None where no model shows one (a CPU host)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    found = re.search(r"^vit_cpu_decode_share\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def start_hey(
    url: str,
    seconds: float,
    concurrency: int,
    body: Path | None = None,
    content_type: str = "",
    headers: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """`hey` started now for `seconds` from `concurrency` workers: POSTing `body` when given, else GETs;
    its report comes on stdout."""
    argv = [require_hey(), "-z", f"{seconds}s", "-c", str(concurrency)]
    argv += [arg for name, value in (headers or {}).items() for arg in ("-H", f"{name}: {value}")]
    if body is not None:
        argv += ["-m", "POST", "-T", content_type, "-D", str(body)]
    return subprocess.Popen([*argv, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_hey(
    url: str, body: Path, content_type: str, concurrency: int, seconds: float, headers: dict[str, str] | None = None
) -> LoadResult:
    """POST `body` for `seconds` from `concurrency` workers; the mean batch size comes from /metrics."""
    parsed = httpx.URL(url)
    base = f"{parsed.scheme}://{parsed.netloc.decode()}"
    before = batch_counters(base)
    proc = start_hey(url, seconds, concurrency, body, content_type, headers)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
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
        p50_ms=pct(50),
        p90_ms=pct(90),
        p99_ms=pct(99),
        ok=ok,
        errors=sum(statuses.values()) - ok + transport_errors,
        mean_batch_size=mean_batch,
        statuses=statuses,
    )
