"""`python -m bench peers` end to end on one light peer (mosec, installed into its own environment by the command's
`--install`): the service (on both backends) and the peer started, their answers checked against each other, each
loaded by `hey`, and the results file, its tables and its plot written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two servers started, a peer's environment made

if shutil.which("hey") is None and not os.environ.get("CI"):
    pytest.skip("needs the hey load generator (apt-get install hey); bin/test installs it", allow_module_level=True)


@pytest.mark.timeout(600)  # a peer's environment made, three servers started and loaded
def test_the_service_and_a_peer_are_checked_loaded_and_reported(tmp_path: Path) -> None:
    argv = ["--install", "--peers", "mosec", "--models", "bundled", "--images", "png-small", "jpeg-medium"]
    argv += ["--concurrency", "1", "8", "--rounds", "1", "--duration", "1", "--warm", "0.5"]
    ran = subprocess.run(
        [sys.executable, "-m", "bench", "peers", *argv, "--name", "peers", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        # an environment of its own: the one in the user's cache points at the checkout that made it, and a clean
        # clone's run must not replace it with one pointing at the clone
        env={**os.environ, "VIT_PEERS_HOME": str(tmp_path / "peers-home")},
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    report = json.loads((tmp_path / "peers.json").read_text())
    model = report["models"]["bundled"]
    # every lane answered each image as the service does
    assert set(model["checks"]) == {"service /predict", "service V2", "service /predict, torch", "mosec"}
    for by_image in model["checks"].values():
        assert set(by_image) == {"png-small", "jpeg-medium"}
        assert all(d <= 1e-5 for d in by_image.values()), model["checks"]
    # and was loaded at every level, with its rate, latency, batches and CPU per request
    for lane, by_image in model["runs"].items():
        for image in ("png-small", "jpeg-medium"):
            for level in ("1", "8"):
                [run] = by_image[image][level]
                assert run["ok"] > 0 and run["errors"] == 0, (lane, image, level, run)
                assert run["requests_per_s"] > 0 and run["p50_ms"] > 0
                assert run["mean_batch"] is not None and run["mean_batch"] >= 1, (lane, run)
                assert run["cpu_us"]["server"] > 0
    # what ran is on record: the peer's version and batching, the service's settings
    version = model["configs"]["mosec"]["version"]  # as the peer's own environment reports it
    assert re.fullmatch(r"mosec \d+\.\d+\.\d+", version), version
    assert model["configs"]["mosec"]["max_batch_size"] == 32
    assert model["configs"]["service"]["backend"] == "onnxruntime"
    assert model["configs"]["service-torch"]["backend"] == "torch"
    text = (tmp_path / "peers.md").read_text()
    assert f"| mosec | {version} | the image's bytes |" in text
    assert "## the bundled checkpoint (64 px, 10 classes), 500x375 JPEG" in text
    assert "| mosec | " in text.split("The service's req/s over each peer's")[1]  # the ratios' table
    assert (tmp_path / "peers.png").read_bytes().startswith(b"\x89PNG")
    # the tables and the plot made again from the figures alone are the same tables
    (tmp_path / "peers.png").unlink()
    again = subprocess.run(
        [sys.executable, "-m", "bench", "peers", "--render", str(tmp_path / "peers.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "peers.md").read_text() == text
    assert (tmp_path / "peers.png").exists()


def test_a_peer_not_installed_is_named_with_the_command_that_installs_it(tmp_path: Path) -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "bench", "peers", "--peers", "kserve", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VIT_PEERS_HOME": str(tmp_path / "none")},
    )
    assert ran.returncode != 0
    assert "kserve is not installed; python -m bench.peers.venvs kserve" in ran.stderr
