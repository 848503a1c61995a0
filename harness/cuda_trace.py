"""Where a decoder's time goes, read from a CUPTI trace (`torch.profiler` with CUDA activities, exported as a
Chrome trace): every CUDA runtime and driver call in the process, the decoder's own threads included, and
every kernel, copy and fill on the GPU.

`summarize(trace, roles)` groups the calls by thread role and name (count, total and longest ms) and the GPU
work by name (count, GPU ms, and how long each waited between its launch call and its start: the queue
behind other streams' work). Pure Python over the trace's JSON, so it is tested without a GPU.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

CALLS = ("cuda_runtime", "cuda_driver")  # host-side API calls
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # what runs on the device
# Calls that wait on the host for the GPU, or may (allocations and frees synchronise the device)
WAITS = (
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaFree",
    "cudaFreeHost",
    "cudaMalloc",
    "cudaHostAlloc",
    "cudaMallocHost",
    "cuStreamSynchronize",
    "cuEventSynchronize",
    "cuCtxSynchronize",
    "cuMemFree",
    "cuMemAlloc",
    "cuMemHostAlloc",
    "cuMemFreeHost",
)


def load(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return list(data["traceEvents"] if isinstance(data, dict) else data)


def summarize(events: list[dict[str, Any]], roles: dict[int, str], per: int = 1, top: int = 15) -> dict[str, Any]:
    """`roles` names threads by their native id (e.g. the forward's and the decoder's); any other thread that
    calls CUDA keeps its id ("thread N": a library's own workers). `per`: what the totals are divided by (decoded batches),
    so runs of different lengths compare."""
    calls: dict[tuple[str, str], list[float]] = defaultdict(list)
    launched: dict[int, tuple[float, str]] = {}  # correlation id -> (end of the launch call in µs, role)
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in CALLS:
            continue
        tid = e.get("tid")
        role = roles.get(tid, f"thread {tid}") if isinstance(tid, int) else "other"
        calls[(role, str(e["name"]))].append(float(e.get("dur", 0.0)))
        correlation = (e.get("args") or {}).get("correlation")
        if correlation is not None:
            launched[int(correlation)] = (float(e["ts"]) + float(e.get("dur", 0.0)), role)
    work: dict[tuple[str, str, str], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_WORK:
            continue
        correlation = (e.get("args") or {}).get("correlation")
        launch = launched.get(int(correlation)) if correlation is not None else None
        queued = max(0.0, float(e["ts"]) - launch[0]) if launch else 0.0
        role = launch[1] if launch else "other"
        work[(str(e["cat"]), role, short(str(e["name"])))].append((float(e.get("dur", 0.0)), queued))
    call_rows = [
        {
            "thread": role,
            "call": name,
            "count": len(d) / per,
            "ms": sum(d) / 1e3 / per,
            "max_ms": max(d) / 1e3,
            "waits": name in WAITS,
        }
        for (role, name), d in calls.items()
    ]
    call_rows.sort(key=lambda r: -r["ms"])
    work_rows = [
        {
            "kind": kind,
            "launched_by": role,
            "name": name,
            "count": len(d) / per,
            "gpu_ms": sum(x for x, _ in d) / 1e3 / per,
            "mean_queued_ms": sum(q for _, q in d) / len(d) / 1e3,
            "max_queued_ms": max(q for _, q in d) / 1e3,
        }
        for (kind, role, name), d in work.items()
    ]
    work_rows.sort(key=lambda r: -r["gpu_ms"])
    waits = defaultdict(float)
    for r in call_rows:
        if r["waits"]:
            waits[r["thread"]] += r["ms"]
    return {
        "per": per,
        "calls": call_rows[:top],
        "waiting_calls_ms": dict(waits),
        "gpu_work": work_rows[:top],
    }


def short(name: str, width: int = 70) -> str:
    """A kernel's name without its template arguments, cut to `width`."""
    plain = name.split("<", 1)[0].split("(", 1)[0]
    return plain if len(plain) <= width else plain[: width - 1] + "…"


def lines(summary: dict[str, Any], title: str) -> list[str]:
    """The summary as Markdown tables."""
    out = [
        f"#### {title}: host calls per batch (CUPTI; longest first)",
        "",
        "| thread | call | calls | ms | longest ms | waits for the GPU |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in summary["calls"]:
        out.append(
            f"| {r['thread']} | `{r['call']}` | {r['count']:.1f} | {r['ms']:.2f} | {r['max_ms']:.2f} | "
            f"{'yes' if r['waits'] else ''} |"
        )
    out += [
        "",
        f"#### {title}: GPU work per batch (longest first)",
        "",
        "| kind | launched by | name | count | GPU ms | mean queued ms | longest queued ms |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in summary["gpu_work"]:
        out.append(
            f"| {r['kind']} | {r['launched_by']} | `{r['name']}` | {r['count']:.1f} | {r['gpu_ms']:.2f} | "
            f"{r['mean_queued_ms']:.2f} | {r['max_queued_ms']:.2f} |"
        )
    return [*out, ""]
