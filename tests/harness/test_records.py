"""`harness.records`: every result written with the record of its run, the commit, the machine and the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.records import VECTOR_EXTENSIONS, table

ROOT = Path(__file__).resolve().parents[2]


def test_a_result_carries_its_commit_machine_and_command(tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path; from harness.records import write_results; "
        "write_results(Path(sys.argv[1]), 'r', {'rows': [1, 2]}, '# A result\\n')"
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("VIT_", "OTEL_"))} | {
        "VIT_BACKEND": "torch"
    }
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), "--flag"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads((tmp_path / "r.json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record = report["record"]
    assert record["commit"].removesuffix("+changes") == head.stdout.strip()
    assert record["machine"]["cores"] == os.cpu_count() and record["machine"]["cpu"]
    assert set(record["machine"]["vector_extensions"]) <= set(VECTOR_EXTENSIONS)
    assert record["command"].startswith("VIT_BACKEND=torch python ")  # the settings its servers inherit, first
    assert record["command"].endswith(f"{tmp_path} --flag")
    assert report["rows"] == [1, 2]
    text = (tmp_path / "r.md").read_text()
    assert text.startswith("# A result\n\nMeasured at " + record["commit"] + " on " + record["machine"]["cpu"])
    assert text.rstrip().endswith(f"`{record['command']}`") and text in done.stdout


def test_a_table_checks_its_columns() -> None:
    assert table(["a", "b"], [["x", 1]]) == ["| a | b |", "|---|---:|", "| x | 1 |"]
    with pytest.raises(ValueError, match="a row of 1 cells in a table of 2 columns"):
        table(["a", "b"], [["x"]])
