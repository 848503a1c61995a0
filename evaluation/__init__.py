"""Evaluations of the model as the service serves it: what quantization, out-of-distribution inputs, phone photos
and the architecture variants do to its answers, and what its drift gauges do when the traffic shifts, each a command (`python -m evaluation.NAME`) writing
evaluation/results/<name>.json and .md with the record of its run (`harness.records`). Serving speed is measured
in bench/; the model alone, on a dataset, by `python -m model.evaluate`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import records

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, report: dict[str, Any], text: str) -> None:
    """evaluation/results/<name>.json and .md: the run's record, then the figures."""
    records.write_results(RESULTS, name, report, text)
