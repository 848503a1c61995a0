"""`python -m bench.compare.protocols`: one checkout's service loaded over `/predict` and over V2 binary in turn, every
request answered, and what each cost the server per request read from /proc."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from harness.preloaded import run_command

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a real server under hey

if shutil.which("hey") is None and not os.environ.get("CI"):
    pytest.skip("needs the hey load generator (apt-get install hey); bin/test installs it", allow_module_level=True)


def test_both_protocols_are_loaded_and_their_cost_per_request_read(tmp_path: Path) -> None:
    name = tmp_path / "protocols"
    command = [sys.executable, "-m", "bench.compare.protocols", "--rounds", "1", "--seconds", "1"]
    command += ["--concurrency", "4", "--name", str(name)]
    run_command(command, cwd=ROOT, check=True, timeout=300)
    report = json.loads(name.with_suffix(".json").read_text())
    assert list(report["runs"]) == ["/predict", "V2 binary"]
    for [run] in report["runs"].values():
        assert run["ok"] > 0 and run["errors"] == 0, run  # a malformed V2 request would be answered 4xx
        assert run["cpu_us"]["server"] > 0
    markdown = name.with_suffix(".md").read_text()
    assert "| /predict |" in markdown and "| V2 binary |" in markdown
