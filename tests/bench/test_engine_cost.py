"""`python -m bench.compare.engine_cost --replay`: replayers keep calls in flight on a real engine process over the
device stand-in, and the engine's CPU per image is read where it, not the driver, sets the pace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.preloaded import run_command

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # an engine process and its replayers


def test_replayers_keep_the_engine_busy_and_its_cpu_per_image_is_read(tmp_path: Path) -> None:
    """The replayed run's result, which also records its commit, machine and command line."""
    name = tmp_path / "replayed"
    command = [sys.executable, "-m", "bench.compare.engine_cost", "--replay", "--repeats", "1", "--seconds", "1"]
    command += ["--images", "2", "--concurrency", "8", "--front-ends", "2", "--name", str(name)]
    run_command(command, cwd=ROOT, check=True, timeout=300)
    report = json.loads(name.with_suffix(".json").read_text())
    assert report["replay"] is True
    [[run]] = report["runs"].values()
    assert run["img_s"] > 0 and run["engine_us_per_image"] > 0
    # the driver only resends: it costs far less per image than the engine it keeps busy
    assert run["driver_us_per_image"] < run["engine_us_per_image"]
    markdown = name.with_suffix(".md").read_text()
    assert "--replay" in markdown
    # every result written carries the record of its run, in its JSON and in a line of its markdown
    record = report["record"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert record["commit"].startswith(head.strip())
    assert record["machine"]["cores"] == os.cpu_count() and record["machine"]["cpu"]
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("VIT_", "OTEL_"))]
    assert record["command"] == " ".join([*settings, "python -m bench.compare.engine_cost", *command[3:]])
    assert f"Measured at {record['commit']} on {record['machine']['cpu']}" in markdown
