"""What Triton's statistics extension costs the hot path: the engine's statistics calls, timed directly.

    python -m bench.compare.statistics_cost --requests 200000

The statistics (app/telemetry/statistics.py) are counters the engine updates as it answers; there is no switch
to turn them off, and what they cost is far below what an A/B of two servers resolves on a shared machine
(rounds move by 5 to 20 %). So this times, with the engine's own classes and functions, the calls one
request makes beside its work:
- a computed request: its model version's entry looked up, `request_timing` (where its time went, from
  the batch it rode in), `answered` and the four durations added; plus, per batch, the `BatchTiming` the
  predictor makes and `batch_done` (counted here once for every `--batch` requests);
- a request answered from the response cache: the entry, the hit and miss durations, `answered`.
It reads the server's CPU per request from `bench/results/cache-cpu.json` (`python -m bench.cache`) where
there is one, to state the share: cache off for a computed request, 64 MiB of cache for a hit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from app.core.engine.timing import request_timing
from app.telemetry.metrics import Metrics, ModelMetrics
from app.telemetry.statistics import BatchTiming, StatisticsBook
from bench.common import RESULTS, write_results
from harness.records import cpu_model, table


class Output:
    """What the predictor hands back per image, as far as the statistics read it."""

    def __init__(self, batch: BatchTiming) -> None:
        self.batch = batch


def computed(requests: int, batch: int) -> float:
    """CPU µs of one computed request's statistics calls (its share of its batch's too)."""
    book = StatisticsBook()
    observer = ModelMetrics(Metrics(), "vit-shapes", book)
    observer.bind_version("1191dfd418c5")
    metrics_only = ModelMetrics(Metrics(), "vit-shapes")  # the /metrics part of batch_done, subtracted below
    began = time.process_time()
    for i in range(requests):
        started = time.monotonic()
        if i % batch == 0:
            timing = BatchTiming(batch, started, 1e-4, 2e-3, 1e-4)
            outputs = [Output(timing)]
            observer.batch_done(batch, 2.2e-3, outputs)
        stats = book.of("vit-shapes", "1191dfd418c5")
        done = request_timing(started, started + 1e-3, started + 3e-3, started + 3.1e-3, outputs)
        stats.answered(1, 3.1e-3)
        stats.queue.add(done.queue)
        stats.compute_input.add(done.compute_input)
        stats.compute_infer.add(done.compute_infer)
        stats.compute_output.add(done.compute_output)
    with_statistics = time.process_time() - began
    began = time.process_time()
    for i in range(requests):
        if i % batch == 0:
            metrics_only.batch_done(batch, 2.2e-3, [Output(BatchTiming(batch, time.monotonic(), 1e-4, 2e-3, 1e-4))])
    metrics_alone = time.process_time() - began
    return (with_statistics - metrics_alone) / requests * 1e6


def hit(requests: int) -> float:
    """CPU µs of one cache hit's statistics calls."""
    book = StatisticsBook()
    began = time.process_time()
    for _ in range(requests):
        stats = book.of("vit-shapes", "1191dfd418c5")
        stats.cache_hit.add(2e-5, count=1)
        stats.cache_miss.add(0.0, count=0)
        stats.answered(1, 3e-5)
    return (time.process_time() - began) / requests * 1e6


def server_cpu_us() -> dict[str, float]:
    """The server's CPU per /predict request from the last `bench.cache` run: cache off and on (medians)."""
    path = RESULTS / "cache-cpu.json"
    if not path.exists():
        return {}
    runs = json.loads(path.read_text())["runs"]
    off = [r["predict_cpu_us"] for r in runs if r["cache_bytes"] == 0]
    on = [r["predict_cpu_us"] for r in runs if r["cache_bytes"] > 0]
    return {"computed": statistics.median(off), "hit": statistics.median(on)} if off and on else {}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.compare.statistics_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200000)
    p.add_argument("--batch", type=int, default=8, help="requests per batch (one image each)")
    p.add_argument("--repeats", type=int, default=5, help="the best of this many runs is reported")
    p.add_argument("--name", default="statistics-cost-cpu")
    args = p.parse_args()
    report: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "requests": args.requests,
        "batch": args.batch,
        "repeats": args.repeats,
        "computed_us": min(computed(args.requests, args.batch) for _ in range(args.repeats)),
        "hit_us": min(hit(args.requests) for _ in range(args.repeats)),
        "server_cpu_us": server_cpu_us(),
    }
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    server = report["server_cpu_us"]
    rows = []
    for key, label in (("computed", "a computed request"), ("hit", "a request answered from the cache")):
        us = report[f"{key}_us"]
        share = f"{us / server[key] * 100:.2f} % of {server[key]:,.0f} µs" if server else "(no bench.cache results)"
        rows.append([label, f"{us:.2f}", share])
    return "\n".join(
        [
            f"# What the statistics extension costs a request ({report['cpu_count']} cores)",
            "",
            f"`python -m bench.compare.statistics_cost --requests {report['requests']} --batch {report['batch']}`: "
            "the engine's statistics calls for one request, timed directly with its own classes (a batch's "
            f"share counted for every {report['batch']} requests; the Prometheus half of the batch observer "
            f"left out); CPU time, the best of {report['repeats']} runs. The share is of the server's CPU per "
            "request in `bench/results/cache-cpu.json` (`python -m bench.cache`, the median run: cache off for "
            f"a computed request, on for a hit). On {report['cpu']}.",
            "",
            *table(["request", "µs of CPU", "share of the request"], rows),
        ]
    )


if __name__ == "__main__":
    main()
