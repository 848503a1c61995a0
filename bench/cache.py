"""The response cache (VIT_CACHE_BYTES): served rate on a workload that repeats its images, on and off.

    python -m bench.cache --rounds 2 --seconds 10 --name cache-cpu

`python -m app` with the bundled model on the CPU. The load cycles over 16 distinct 500x375 JPEGs at
concurrency 32: 16 `hey` processes, each posting its own image to `/predict` (multipart) from 2
workers. Rounds alternate between VIT_CACHE_BYTES=0 (off) and 64 MiB; each round also measures
`GET /health/live` at concurrency 32, what a request costs that does no inference at all, and the same
uploads to a path with no route, answered 404 as soon as they are read: what taking the bytes in costs. What a request
costs is the server's CPU time (user + system, from /proc) over the requests answered: on 2 cores the
`hey` processes take their share of the CPU too, and more of it to upload images than to ask for /health.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import httpx

from app.settings import BUNDLED_WEIGHTS
from bench.common import multipart, write_results
from harness.load import parse_hey, start_hey
from harness.records import table
from harness.server import Server
from model.shapes import make_sample

IMAGES = 16
UNROUTED = "/no-such-route"  # the same uploads, answered 404 at once: what taking the bytes in costs
CACHE_BYTES = 64 * 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--name", default="cache-cpu")
    return p.parse_args()


def photos() -> list[bytes]:
    out = []
    for i in range(IMAGES):
        buf = io.BytesIO()
        make_sample(9000 + i, i % 10).image.resize((500, 375)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def rate(out: str) -> tuple[float, int, int]:
    """Requests/s, failed requests and answers in all from one hey report."""
    result = parse_hey(out, 0, None)
    return result.requests_per_s, result.errors, sum(result.statuses.values())


def measure(cache_bytes: int, bodies: list[tuple[Path, str]], seconds: float) -> dict[str, Any]:
    with Server(BUNDLED_WEIGHTS, VIT_CACHE_BYTES=str(cache_bytes), VIT_LOG_LEVEL="warning") as server:
        url = server.url + "/predict"
        for proc in [start_hey(url, 2, 2, body, ct) for body, ct in bodies]:  # warm (and fill the cache)
            proc.communicate()
        cpu = server.cpu_seconds()
        procs = [start_hey(url, seconds, 2, body, ct) for body, ct in bodies]
        results = [rate(p.communicate()[0]) for p in procs]
        predict_cpu, cpu = server.cpu_seconds() - cpu, server.cpu_seconds()
        health = rate(start_hey(server.url + "/health/live", seconds, 32).communicate()[0])
        health_cpu, cpu = server.cpu_seconds() - cpu, server.cpu_seconds()
        procs = [start_hey(server.url + UNROUTED, seconds, 2, body, ct) for body, ct in bodies]
        refused = [rate(p.communicate()[0]) for p in procs]
        refused_cpu = server.cpu_seconds() - cpu
        metrics = httpx.get(server.url + "/metrics").text
    hits = sum(float(v) for v in re.findall(r"^vit_cache_hits_total\{[^}]*\} (\S+)", metrics, re.MULTILINE))
    misses = sum(float(v) for v in re.findall(r"^vit_cache_misses_total\{[^}]*\} (\S+)", metrics, re.MULTILINE))
    return {
        "cache_bytes": cache_bytes,
        "predict_per_s": round(sum(r for r, _, _ in results), 1),
        "errors": sum(e for _, e, _ in results),
        "health_per_s": round(health[0], 1),
        "predict_cpu_us": round(predict_cpu / sum(n for _, _, n in results) * 1e6),
        "health_cpu_us": round(health_cpu / health[2] * 1e6),
        "refused_cpu_us": round(refused_cpu / sum(n for _, _, n in refused) * 1e6),
        "hits": int(hits),
        "misses": int(misses),
    }


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as folder:
        bodies = []
        for i, jpeg in enumerate(photos()):
            data, content_type = multipart(jpeg, f"photo{i}.jpg", "image/jpeg")
            path = Path(folder) / f"{i}.body"
            path.write_bytes(data)
            bodies.append((path, content_type))
        runs = []
        for _ in range(args.rounds):
            for cache_bytes in (0, CACHE_BYTES):
                run = measure(cache_bytes, bodies, args.seconds)
                print(run, flush=True)
                runs.append(run)
    report = {"cpu_count": os.cpu_count(), "images": IMAGES, "concurrency": 32, "seconds": args.seconds, "runs": runs}
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Response cache on the CPU ({report['cpu_count']} cores)",
        "",
        f"`python -m bench.cache`: the bundled model, `/predict` cycling over {report['images']} distinct 500x375 "
        f"JPEGs at concurrency {report['concurrency']}, {report['seconds']:.0f} s per run, rounds alternating; "
        "`GET /health/live` at concurrency 32 in the same server after each run, then the same uploads to "
        f"`{UNROUTED}` (answered 404 once read). A request's cost is the "
        "server's CPU time (user + system) over the requests it answered.",
        "",
        *table(
            [
                "VIT_CACHE_BYTES",
                "/predict req/s",
                "errors",
                "hits",
                "misses",
                "/health/live req/s",
                "/predict : /health",
                "server CPU per /predict",
                "per /health/live",
                "CPU ratio",
                "per upload answered 404",
            ],
            [
                [
                    r["cache_bytes"],
                    f"{r['predict_per_s']:.1f}",
                    r["errors"],
                    r["hits"],
                    r["misses"],
                    f"{r['health_per_s']:.1f}",
                    f"{r['predict_per_s'] / r['health_per_s']:.2f}",
                    f"{r['predict_cpu_us']} µs",
                    f"{r['health_cpu_us']} µs",
                    f"{r['predict_cpu_us'] / r['health_cpu_us']:.1f}",
                    f"{r['refused_cpu_us']} µs",
                ]
                for r in report["runs"]
            ],
        ),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
