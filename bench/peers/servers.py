"""How each server of the comparison is started and asked: the service (over `/predict` and over V2 binary) and
every peer, each in its own environment (`bench.peers.venvs`), with the same checkpoint, largest batch, batch wait
and torch threads, and the request format its docs recommend; and how the probabilities are read from each answer.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import multipart
from bench.peers import venvs
from harness.load import v2_body
from harness.server import ROOT, Server, ServerProcess, free_ports


@dataclass(frozen=True)
class Settings:
    """What every server is given alike."""

    weights: Path
    max_batch_size: int = 32
    wait_ms: float = 5.0
    threads: int = 1


@dataclass(frozen=True)
class Request:
    path: str
    body: bytes
    content_type: str
    headers: dict[str, str]


@dataclass(frozen=True)
class Lane:
    """One server asked one way: a row of the results."""

    name: str  # the row's label
    server: str  # the server it asks (several lanes can share one: the service's two protocols)
    protocol: str  # what the request is, in words
    batching: str  # how the server batches, in words
    ask: Callable[[bytes, str], Request]  # (image, its content type) -> the request the load posts
    check: Callable[[bytes, str], Request]  # the same image asked for an answer whose probabilities can be read
    read: Callable[[httpx.Response], list[float]]


@dataclass
class Started:
    process: ServerProcess
    config: dict[str, Any]  # what ran: version, batching and process settings, as the results record them
    stats: Path | None = None  # the peer's batch counts (bench.peers.work)


def raw(path: str) -> Callable[[bytes, str], Request]:
    return lambda image, kind: Request(path, image, kind, {})


def form(path: str, field: str) -> Callable[[bytes, str], Request]:
    def ask(image: bytes, kind: str) -> Request:
        body, content_type = multipart(image, "image." + kind.split("/")[1], kind)
        body = body.replace(b'name="file"', f'name="{field}"'.encode(), 1)
        return Request(path, body, content_type, {})

    return ask


def v2_binary(path: str, batch_dim: bool, binary_out: bool) -> Callable[[bytes, str], Request]:
    """A V2 binary request of one image (shape [1], or [1, 1] where the model's first dimension is the batch)."""

    def ask(image: bytes, kind: str) -> Request:
        body, headers = v2_body([image])
        head_length = int(headers["Inference-Header-Content-Length"])
        head = json.loads(body[:head_length])
        if batch_dim:
            head["inputs"][0]["shape"] = [1, 1]
        head["outputs"][0]["parameters"]["binary_data"] = binary_out
        encoded = json.dumps(head).encode()
        return Request(
            path,
            encoded + body[head_length:],
            "application/octet-stream",
            {"Inference-Header-Content-Length": str(len(encoded))},
        )

    return ask


def v2_base64(path: str, content_type_parameter: bool) -> Callable[[bytes, str], Request]:
    """A V2 JSON request of one image in base64 (MLServer names its codec with `content_type: base64`)."""

    def ask(image: bytes, kind: str) -> Request:
        tensor: dict[str, Any] = {
            "name": "image",
            "datatype": "BYTES",
            "shape": [1],
            "data": [base64.b64encode(image).decode()],
        }
        if content_type_parameter:
            tensor["parameters"] = {"content_type": "base64"}
        return Request(path, json.dumps({"inputs": [tensor]}).encode(), "application/json", {})

    return ask


def read_probabilities(r: httpx.Response) -> list[float]:
    answer = r.json()
    if isinstance(answer, list):  # BentoML answers a batchable API's item in a list
        answer = answer[0]
    probs: list[float] = answer["probabilities"]
    return probs


def read_predict(r: httpx.Response) -> list[float]:
    probs: list[float] = r.json()["results"][0]["probabilities"]
    return probs


def read_v2(r: httpx.Response) -> list[float]:
    [out] = [o for o in r.json()["outputs"] if o["name"] == "probabilities"]
    data: list[float] = out["data"]
    return data


def peer_env(peer: str, settings: Settings, stats: Path) -> dict[str, str]:
    """The environment a peer starts in: its own interpreter first on PATH, the repository importable, the shared
    settings, and its batch counts' folder."""
    bin_dir = str(venvs.python(peer).parent)
    return {
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venvs.home() / peer),
        "PYTHONPATH": str(ROOT),
        "VIT_PEER_WEIGHTS": str(settings.weights.resolve()),
        "VIT_PEER_THREADS": str(settings.threads),
        "VIT_PEER_MAX_BATCH": str(settings.max_batch_size),
        "VIT_PEER_STATS": str(stats),
        "OMP_NUM_THREADS": str(settings.threads),
    }


def start_service(settings: Settings, backend: str) -> Started:
    """The service with `backend`: `onnxruntime` (its default on a CPU host) or `torch` (the peers' runtime)."""
    server = Server(
        settings.weights,
        VIT_THREADS=str(settings.threads),
        VIT_MAX_BATCH_SIZE=str(settings.max_batch_size),
        VIT_MAX_WAIT_MS=str(settings.wait_ms),
        VIT_MAX_QUEUE="4096",
        VIT_LOG_LEVEL="warning",
        VIT_CACHE_BYTES="0",
        VIT_BACKEND=backend,
    )
    config = {
        "backend": backend,
        "threads": settings.threads,
        "max_batch_size": settings.max_batch_size,
        "max_wait_ms": settings.wait_ms,
        "response_cache": "off (every request runs the model, as at every peer)",
    }
    return Started(server, config)


def start_peer(peer: str, settings: Settings, folder: Path) -> Started:
    """A peer, started in its own environment; `folder` holds what it writes (settings, archives, batch counts)."""
    stats = folder / "stats"
    stats.mkdir(parents=True, exist_ok=True)
    env = peer_env(peer, settings, stats)
    py = str(venvs.python(peer))
    port, second, third = free_ports(3)  # HTTP, and the gRPC and metrics ports of the peers that open them
    ports = f"{port},{second},{third}"
    b, w = settings.max_batch_size, settings.wait_ms
    config: dict[str, Any] = {"max_batch_size": b, "wait_ms": w, "threads": settings.threads}
    ready = "/"
    if peer == "litserve":
        argv = [py, "-m", "bench.peers.litserve_server", "--weights", str(settings.weights), "--port", str(port)]
        argv += ["--max-batch-size", str(b), "--wait-ms", str(w), "--threads", str(settings.threads)]
        argv += ["--backend", "torch", "--decode", "cpu"]
        ready, config["api_servers"], config["workers_per_device"] = "/health", 1, 1
    elif peer == "mosec":
        argv = [py, "-m", "bench.peers.mosec_server", "--port", str(port), "--decoders", "2"]
        argv += ["--max-batch-size", str(b), "--wait-ms", str(int(w))]
        config.update(decode_workers=2, timeout_ms=120_000)
    elif peer == "triton":
        # pytriton#51: its helper process must find the interpreter's own libpython
        env["LD_LIBRARY_PATH"] = str(sysconfig.get_config_var("LIBDIR"))
        argv = [py, "-m", "bench.peers.triton_server", "--port", str(port), "--grpc-port", str(second)]
        argv += ["--metrics-port", str(third), "--max-batch-size", str(b), "--wait-ms", str(w)]
        ready = "/v2/health/ready"
        config["dynamic_batcher"] = {"max_queue_delay_microseconds": int(w * 1000)}
    elif peer == "mlserver":
        code = (
            "import sys; from pathlib import Path; from bench.peers.mlserver_runtime import write_settings; "
            "write_settings(Path(sys.argv[1]), Path(sys.argv[2]), [int(p) for p in sys.argv[3].split(',')], "
            "int(sys.argv[4]), float(sys.argv[5]))"
        )
        settings_dir = folder / "mlserver"
        run_in(env, [py, "-c", code, str(settings_dir), str(settings.weights), ports, str(b), str(w)])
        argv = [str(venvs.python(peer).with_name("mlserver")), "start", str(settings_dir)]
        ready = "/v2/models/vit/ready"
        config.update(adaptive_batching=True, parallel_workers=1)
    elif peer == "torchserve":
        code = (
            "import sys; from pathlib import Path; from bench.peers.torchserve_handler import write_store; "
            "write_store(Path(sys.argv[1]), Path(sys.argv[2]), [int(p) for p in sys.argv[3].split(',')], "
            "int(sys.argv[4]), float(sys.argv[5]))"
        )
        store = folder / "torchserve"
        run_in(env, [py, "-c", code, str(store), str(settings.weights), ports, str(b), str(w)])
        argv = [str(venvs.python(peer).with_name("torchserve")), "--start", "--foreground", "--ncs"]
        argv += ["--model-store", str(store), "--ts-config", str(store / "config.properties")]
        ready = "/ping"
        config.update(workers=1, batch_size=b, max_batch_delay_ms=int(w))
    elif peer == "bentoml":
        argv = [str(venvs.python(peer).with_name("bentoml")), "serve", "bench.peers.bentoml_service:ViT"]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        ready = "/readyz"
        config.update(workers=1, batchable=True)
    elif peer == "rayserve":
        argv = [py, "-m", "bench.peers.rayserve_server", "--port", str(port), "--max-batch-size", str(b)]
        argv += ["--wait-ms", str(w)]
        ready = "/-/healthz"
        config.update(replicas=1, max_ongoing_requests=512)
    elif peer == "kserve":
        argv = [py, "-m", "bench.peers.kserve_server", "--port", str(port), "--grpc-port", str(second)]
        ready = "/v2/models/vit/ready"
        config.update(batching="none: KServe's batcher is a sidecar on Kubernetes", workers=1)
        config.pop("max_batch_size"), config.pop("wait_ms")
    else:
        raise ValueError(f"no peer {peer!r}")
    config["version"] = f"{venvs.PEERS[peer].package} {venvs.version(venvs.PEERS[peer])}"
    return Started(ServerProcess(argv, env, port, ready, cwd=folder), config, stats)


def run_in(env: dict[str, str], argv: list[str]) -> None:
    """A step of a peer's setup (its settings, its archive), run in the peer's environment."""
    subprocess.run(argv, env={**os.environ, **env}, check=True, cwd=ROOT, capture_output=True)


def answer(server: ServerProcess, request: Request, timeout: float = 180) -> httpx.Response:
    """The server's first good answer to `request`, retried while it still loads (some say they are ready
    before their model is)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.post(
                server.url + request.path,
                content=request.body,
                headers={"content-type": request.content_type, **request.headers},
                timeout=60,
            )
            if r.status_code == 200 or time.monotonic() > deadline:
                r.raise_for_status()
                return r
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited:\n{server.read_output()[-4000:]}")
        time.sleep(0.5)


SERVICE_BATCHING = "its dynamic batcher: up to the largest batch, waiting at most the batch wait"


def lanes(service_model: str) -> dict[str, Lane]:
    """Every lane of the comparison, by name; `service_model` is the name the service serves the checkpoint under."""
    v2 = f"/v2/models/{service_model}/infer"
    all_lanes = [
        Lane(
            "service /predict",
            "service",
            "the image's bytes",
            SERVICE_BATCHING,
            raw("/predict"),
            raw("/predict"),
            read_predict,
        ),
        Lane(
            "service /predict, torch",
            "service-torch",
            "the image's bytes",
            SERVICE_BATCHING,
            raw("/predict"),
            raw("/predict"),
            read_predict,
        ),
        Lane(
            "service V2",
            "service",
            "V2 binary (BYTES in, FP32 out)",
            SERVICE_BATCHING,
            v2_binary(v2, False, True),
            v2_binary(v2, False, False),
            read_v2,
        ),
        Lane(
            "litserve",
            "litserve",
            "multipart upload",
            "`max_batch_size`, `batch_timeout`",
            form("/predict", "file"),
            form("/predict", "file"),
            read_probabilities,
        ),
        Lane(
            "mosec",
            "mosec",
            "the image's bytes",
            "`max_batch_size`, `max_wait_time`; 2 decoding workers",
            raw("/inference"),
            raw("/inference"),
            read_probabilities,
        ),
        Lane(
            "triton",
            "triton",
            "V2 binary (BYTES in, FP32 out)",
            "Triton's dynamic batcher (`max_queue_delay_microseconds`)",
            v2_binary("/v2/models/vit/infer", True, True),
            v2_binary("/v2/models/vit/infer", True, False),
            read_v2,
        ),
        Lane(
            "mlserver",
            "mlserver",
            "V2 JSON, base64 BYTES",
            "adaptive batching (`max_batch_size`, `max_batch_time`)",
            v2_base64("/v2/models/vit/infer", True),
            v2_base64("/v2/models/vit/infer", True),
            read_v2,
        ),
        Lane(
            "torchserve",
            "torchserve",
            "the image's bytes",
            "`batchSize`, `maxBatchDelay`; 1 worker",
            raw("/predictions/vit"),
            raw("/predictions/vit"),
            read_probabilities,
        ),
        Lane(
            "bentoml",
            "bentoml",
            "multipart upload",
            "adaptive batching (`batchable`, `max_batch_size`)",
            form("/classify", "image"),
            form("/classify", "image"),
            read_probabilities,
        ),
        Lane(
            "rayserve",
            "rayserve",
            "the image's bytes",
            "`@serve.batch` (`max_batch_size`, `batch_wait_timeout_s`)",
            raw("/predict"),
            raw("/predict"),
            read_probabilities,
        ),
        Lane(
            "kserve",
            "kserve",
            "V2 JSON, base64 BYTES",
            "none (KServe's batcher is a Kubernetes sidecar)",
            v2_base64("/v2/models/vit/infer", False),
            v2_base64("/v2/models/vit/infer", False),
            read_v2,
        ),
    ]
    return {lane.name: lane for lane in all_lanes}


def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="vit-peers-"))
