"""One server's runs at one level, as the tables and the plot give them: the mean over the rounds."""

from __future__ import annotations

import statistics
from typing import Any


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """req/s answered (a refusal counted out), p50, p99, errors, mean batch and CPU µs per request."""

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in runs)

    def answered(r: dict[str, Any]) -> float:  # hey's rate counts every answer; a refusal serves nobody
        return float(r["requests_per_s"] * r["ok"] / max(r["ok"] + r["errors"], 1))

    batches = [r["mean_batch"] for r in runs if r["mean_batch"] is not None]
    return {
        "requests_per_s": statistics.mean(answered(r) for r in runs),
        "p50_ms": mean("p50_ms"),
        "p99_ms": mean("p99_ms"),
        "errors": sum(r["errors"] for r in runs),
        "mean_batch": statistics.mean(batches) if batches else None,
        "cpu_us": statistics.mean(r["cpu_us"]["server"] for r in runs),
    }
