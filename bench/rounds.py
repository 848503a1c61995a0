"""Configurations measured against each other: servers or checkouts run in turns over rounds, the order reversed
every other round, so that whatever else the machine does over the run falls on each alike; and one loaded run of a
server, its rate, latency and CPU per request by process role, as every scenario under `hey` reads it."""

from __future__ import annotations

import resource
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from harness.cpu import cpu_by_role, roles
from harness.load import run_hey
from harness.records import table
from harness.server import ServerProcess

T = TypeVar("T")
R = TypeVar("R")


def alternated(configs: Sequence[T], repeats: int, run: Callable[[T], R]) -> dict[str, list[R]]:
    """`run(config)` for every config, `repeats` times, in the order reversed every other repeat (A B, B A, A B,
    ...); each config's results under `str(config)`, in the order they were measured."""
    runs: dict[str, list[R]] = {str(c): [] for c in configs}
    for repeat in range(repeats):
        for config in configs if repeat % 2 == 0 else configs[::-1]:
            runs[str(config)].append(run(config))
    return runs


def loaded(
    server: ServerProcess,
    path: str,
    body: Path,
    content_type: str,
    concurrency: int,
    seconds: float,
    workers: int = 1,
    warm: float = 2.0,
    headers: dict[str, str] | None = None,
    batches: Callable[[], tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """`body` posted to `path` for `seconds` from `concurrency` connections after `warm` seconds of the same load:
    its rate, latency, answers and mean batch, and the CPU each role spent per request answered, in µs: `server`
    (all of its processes), with serving processes (`workers` of them) also `engine`, `front-ends` and `supervisor`,
    and `load generator` (hey). The mean batch is the service's (/metrics), or read from `batches` (the images and
    batches a server has run so far) where it is given."""
    url = server.url + path
    if warm:
        run_hey(url, body, content_type, concurrency, warm, headers)
    pids = roles(server.proc.pid, workers) if workers > 1 else {}

    def cpu() -> dict[str, float]:
        by_role = {k: v for k, v in cpu_by_role(pids).items() if k != "other"}
        hey = resource.getrusage(resource.RUSAGE_CHILDREN)  # hey's, once it has exited
        return {"server": server.cpu_seconds(), **by_role, "load generator": hey.ru_utime + hey.ru_stime}

    before, counted = cpu(), batches() if batches else None
    result = run_hey(url, body, content_type, concurrency, seconds, headers)
    after = cpu()
    if batches and counted:
        images, runs = (now - then for now, then in zip(batches(), counted, strict=True))
        result.mean_batch_size = images / runs if runs else None
    answered = max(result.ok + result.errors, 1)
    return {
        "requests_per_s": result.requests_per_s,
        "p50_ms": result.p50_ms,
        "p99_ms": result.p99_ms,
        "ok": result.ok,
        "errors": result.errors,
        "mean_batch": result.mean_batch_size,
        "cpu_us": {role: round((after[role] - before[role]) / answered * 1e6, 1) for role in after},
    }


SPLIT = ("engine", "front-ends")  # the roles given beside the whole server's CPU


def each(values: Sequence[float], form: str = ".1f") -> str:
    return ", ".join(f"{v:{form}}" for v in values)


def rounds_table(runs: Mapping[str, Sequence[Mapping[str, Any]]], label: str = "server") -> list[str]:
    """One row per configuration, from its runs as `loaded` gives them: its rate each round, the mean and its ratio
    to the first configuration's, p99, errors, and the CPU per request of each role, each round, the server's mean
    beside the first's."""
    first = next(iter(runs.values()))
    base_rate = statistics.mean(r["requests_per_s"] for r in first)
    base_cpu = statistics.mean(r["cpu_us"]["server"] for r in first)
    split = [role for role in SPLIT if any(role in r["cpu_us"] for rs in runs.values() for r in rs)]
    rows = []
    for name, rs in runs.items():
        rate = statistics.mean(r["requests_per_s"] for r in rs)
        cpu = statistics.mean(r["cpu_us"]["server"] for r in rs)
        rows.append(
            [
                name,
                each([r["requests_per_s"] for r in rs]),
                f"{rate:.1f}",
                f"{rate / base_rate:.3f}",
                each([r["p99_ms"] for r in rs]),
                sum(r["errors"] for r in rs),
                each([r["cpu_us"]["server"] for r in rs], ".0f"),
                f"{cpu - base_cpu:+.0f}",
                *(each([r["cpu_us"][role] for r in rs], ".0f") if role in rs[0]["cpu_us"] else "-" for role in split),
            ]
        )
    header = [label, "req/s (each round)", "mean", "of the first", "p99 ms", "errors", "server CPU µs per request"]
    return table([*header, "beside the first", *(f"{role} CPU µs" for role in split)], rows)
