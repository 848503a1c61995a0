"""`harness.records`: every result written with the record of its run, the commit, the machine and the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.records import VECTOR_EXTENSIONS, commit, table

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


def test_only_changed_code_marks_a_tree_changed(tmp_path: Path) -> None:
    def git(*argv: str) -> None:
        subprocess.run(["git", *argv], cwd=tmp_path, capture_output=True, check=True)

    files = {"app.py": "x = 1\n", "bench/results/r.json": "{}\n", "evaluation/results/e.md": "a\n", "docs/d.md": "b\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    for name in list(files)[1:]:  # results and documentation
        (tmp_path / name).write_text("changed\n")
    assert not commit(tmp_path).endswith("+changes")
    (tmp_path / "app.py").write_text("x = 2\n")
    assert commit(tmp_path).endswith("+changes")
