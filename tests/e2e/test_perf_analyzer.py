"""NVIDIA's perf_analyzer, unchanged (bin/perf-analyzer: tritonclient 2.41.1's binary), measures a real server
over HTTP and gRPC, and through system shared memory: it reads the model's metadata and configuration, sends
the encoded JPEG its input data gives and nothing else, and prints the server's own statistics for what it
sent."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import struct
import subprocess
from pathlib import Path

import httpx
import pytest

from app.settings import BUNDLED_WEIGHTS
from harness.server import ROOT, Server
from model.shapes import make_sample
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
MODEL = "vit-shapes"
PERF_ANALYZER = ROOT / "bin" / "perf-analyzer"


@pytest.fixture(scope="module")
def installed() -> None:
    done = subprocess.run([PERF_ANALYZER, "--install"], capture_output=True, text=True)
    if done.returncode != 0:
        missing = f"perf_analyzer could not be installed: {done.stderr.strip()[-500:]}"
        if os.environ.get("CI") == "true":
            pytest.fail(missing)  # in CI a missing tool is a failure, never a silent skip
        pytest.skip(missing)


@pytest.fixture(scope="module")
def server(serve: ServerFactory, installed: None) -> Server:
    return serve(BUNDLED_WEIGHTS, VIT_MODELS=f"{MODEL}={BUNDLED_WEIGHTS}")


@pytest.fixture(scope="module")
def plain(serve: ServerFactory, installed: None) -> Server:
    """Listing probabilities alone (VIT_V2_OUTPUTS=probabilities): perf_analyzer, which asks for every output the
    metadata lists, measures a plain classification."""
    return serve(BUNDLED_WEIGHTS, VIT_MODELS=f"{MODEL}={BUNDLED_WEIGHTS}", VIT_V2_OUTPUTS="probabilities")


@pytest.fixture(scope="module")
def image_only(serve: ServerFactory, installed: None) -> Server:
    """Taking image files alone (perf_analyzer's shared-memory mode sends every input the metadata lists), from
    two front-end processes: regions registered through one connection serve requests through any."""
    return serve(BUNDLED_WEIGHTS, VIT_MODELS=f"{MODEL}={BUNDLED_WEIGHTS}", VIT_V2_PIXELS="false", VIT_WORKERS="2")


@pytest.fixture(scope="module")
def input_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """perf_analyzer's --input-data: one JPEG as the `image` tensor's serialized bytes (a 4-byte little-endian
    length, then the file), base64 in "b64", as its docs give BYTES data."""
    buf = io.BytesIO()
    make_sample(20261125, 5).image.convert("RGB").save(buf, format="JPEG", quality=90)
    element = struct.pack("<I", len(buf.getvalue())) + buf.getvalue()
    path = tmp_path_factory.mktemp("perf") / "image.json"
    path.write_text(json.dumps({"data": [{"image": {"b64": base64.b64encode(element).decode()}}]}))
    return path


def inference_count(server: Server) -> int:
    stats = httpx.get(f"{server.url}/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"]
    return sum(s["inference_count"] for s in stats)


def measure(server: Server, protocol: str, input_data: Path, *extra: str) -> None:
    url = server.url.removeprefix("http://") if protocol == "http" else server.grpc_target
    before = inference_count(server)
    command = [PERF_ANALYZER, "-m", MODEL, "-u", url, "-i", protocol, "--input-data", str(input_data), *extra]
    # the figures are not the test's, so any three windows count as stable: perf_analyzer calls a run stable when
    # the slowest of its last three windows is within the percentage of the fastest, and on a shared 2-core
    # machine one window in a run can stall for more than twice the others'
    command += ["--measurement-interval", "500", "--stability-percentage", "100000", "--max-trials", "5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Server: " in out, out
    sent = int(re.search(r"Client: \n\s+Request count: (\d+)", out).group(1))  # type: ignore[union-attr]
    counted = int(re.search(r"Server: \n\s+Inference count: (\d+)", out).group(1))  # type: ignore[union-attr]
    assert sent > 0 and abs(counted - sent) <= 2, out  # the window's edges may cut one request either way
    assert inference_count(server) - before >= sent  # the service counted every request it was sent


def listed_outputs(server: Server) -> list[str]:
    return [o["name"] for o in httpx.get(f"{server.url}/v2/models/{MODEL}", timeout=10).json()["outputs"]]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_service_with_its_statistics(
    server: Server, input_data: Path, protocol: str
) -> None:
    """Every output listed, so every output computed: probabilities, a rollout map, the embedding and the
    out-of-distribution score (the bundled model has reference statistics)."""
    assert listed_outputs(server) == ["probabilities", "attention", "embedding", "ood_score"]
    measure(server, protocol, input_data)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_a_plain_classification_where_only_probabilities_are_listed(
    plain: Server, input_data: Path, protocol: str
) -> None:
    assert listed_outputs(plain) == ["probabilities"]
    measure(plain, protocol, input_data)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_through_system_shared_memory(
    image_only: Server, input_data: Path, protocol: str
) -> None:
    measure(image_only, protocol, input_data, "--shape", "image:1", "--shared-memory=system")
    # it unregisters what it registered when it ends, and unlinks its objects
    assert httpx.get(f"{image_only.url}/v2/systemsharedmemory/status").json() == []
