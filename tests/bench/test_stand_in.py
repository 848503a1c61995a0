"""`python -m bench.stand_in --trees`: two checkouts' services over the device stand-in, each serving its own code,
measured in turn under the same load, with the record and a row per tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.preloaded import run_command

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two services started, and a load on each


def test_two_trees_are_served_in_turn_and_compared(tmp_path: Path) -> None:
    other = tmp_path / "other"
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(other)], check=True)  # HEAD, committed code
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=other, capture_output=True, text=True).stdout
    out = tmp_path / "ab.json"
    argv = [
        "--model",
        "vit-s16",
        "--route",
        "v2",
        "--workers",
        "1",
        "--seconds",
        "1",
        "--trees",
        ".",
        str(other),
        "--json",
        str(out),
    ]
    ran = run_command([sys.executable, "-m", "bench.stand_in", *argv], cwd=ROOT, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["record"]["command"].endswith(" ".join(argv))
    runs = report["runs"]
    assert [r["tree"] for r in runs] == [str(ROOT), str(other)]  # one run each, in order
    assert runs[1]["commit"] == head.strip()  # the other tree's own commit
    for r in runs:
        assert r["errors"] == 0 and r["served_img_s"] > 0 and r["engine_cpu_us_per_image"] > 0
    rows = [line for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| 1 |")]
    assert [row.split(" | ")[1] for row in rows] == [str(ROOT), str(other)]
    refused = run_command([sys.executable, "-m", "bench.stand_in", "--trees", ".", "--replay"], cwd=ROOT)
    assert refused.returncode == 2 and "--trees compares the services as measured" in refused.stderr
