"""`python -m model.evaluate` as a user runs it: a report and its JSON, or one line saying what is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.settings import BUNDLED_WEIGHTS
from harness.preloaded import run_command

pytestmark = pytest.mark.slow  # each test runs the command line as a process of its own


def evaluate(*argv: str) -> subprocess.CompletedProcess[str]:
    return run_command([sys.executable, "-m", "model.evaluate", *argv], timeout=300)


def test_a_report_and_its_json(tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    done = evaluate("--checkpoint", str(BUNDLED_WEIGHTS), "--samples", "40", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "accuracy" in done.stdout.lower()
    result = json.loads(out.read_text())
    assert result["checkpoint"] == str(BUNDLED_WEIGHTS) and 0 <= result["accuracy"] <= 1


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--checkpoint", "/nonexistent/model.safetensors"],
            "checkpoint /nonexistent/model.safetensors: file not found",
        ),
        (
            ["--checkpoint", str(BUNDLED_WEIGHTS), "--dataset", "cifar10", "--data-dir", "/nonexistent"],
            "CIFAR10 files not found under /nonexistent/cifar-10-batches-py; pass --download",
        ),
    ],
    ids=["missing-checkpoint", "missing-dataset"],
)
def test_what_is_missing_is_one_line_without_a_traceback(argv: list[str], said: str) -> None:
    done = evaluate(*argv)
    assert done.returncode == 1
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--samples", "0"], "argument --samples: must be at least 1, got 0"),  # it reported on no images
        (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),  # a traceback
    ],
)
def test_counts_below_one_are_refused(argv: list[str], message: str) -> None:
    done = evaluate("--checkpoint", str(BUNDLED_WEIGHTS), *argv)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
