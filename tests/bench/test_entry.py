"""`python -m bench`: every scenario listed from one command, and one run through it as through its own module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.preloaded import run_command

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # the entry, as processes of their own


def bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return run_command([sys.executable, "-m", "bench", *argv], cwd=ROOT, timeout=120)


def test_the_scenarios_are_listed_each_with_what_it_measures() -> None:
    listed = bench()
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines()[2:] if line.strip()}
    for name in ("run", "stand_in", "gpu", "compare.engine_cost", "compare.tracing", "batch"):
        assert name in lines, listed.stdout
    assert "litserve_server" not in lines and "common" not in lines  # the peer's server and helpers are no scenario
    assert "One run of the serving benchmark" in lines["run"]


def test_a_scenario_runs_as_its_module_does_and_an_unknown_one_is_one_line(tmp_path: Path) -> None:
    name = tmp_path / "features"
    ran = bench("feature-cost", "--requests", "40", "--repeats", "1", "--name", str(name))
    assert ran.returncode == 0, ran.stderr
    report = json.loads(name.with_suffix(".json").read_text())
    assert " python -m bench.feature_cost --requests 40" in " " + report["record"]["command"]
    timed = {"statistics_computed", "statistics_hit", "monitoring", "tracing_off", "span_both", "header_markers_exif"}
    assert timed <= set(report["us"]), report["us"]  # every feature's calls were timed
    assert "| statistics | a computed request |" in name.with_suffix(".md").read_text()
    unknown = bench("nope")
    assert unknown.returncode == 1 and unknown.stderr.startswith("python -m bench: no scenario 'nope'; there are: ")
    assert len(unknown.stderr.strip().splitlines()) == 1
