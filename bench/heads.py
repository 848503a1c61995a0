"""Heads taught by example: what a request to one costs beside the backbone's own embedding request, what ten heads
take in memory, how long teaching takes past the examples' embedding, and what teaching does to traffic's p99.

    python -m bench heads --rounds 3 --seconds 8 --name heads-cpu

`python -m app` serving a copy of the bundled checkpoint (its heads are written beside it, in a folder of the run's
own), one process. The lesson is `--classes` classes of `--per-class` PNGs each from the second renderer (shapes the
model was not trained on), sent over HTTP as a user sends it:
- time to teach: the lesson's images posted to `/predict?embedding=true` in requests of eight (as teaching embeds
  them), then the same lesson taught (`POST /v1/models/{name}/heads/{head}`); the first teach in a process and a
  later one;
- memory: the server's resident memory before and after ten heads, and their files' size;
- cost: one 64 px PNG posted to `/predict?embedding=true` and to `/predict?head=...` at concurrency
  `--concurrency`, in alternated rounds; the server's CPU per request (from /proc) and the rate;
- teaching under traffic: `/predict` at concurrency `--concurrency`, alone, with one lesson taught a second into
  the run, and while a client teaches the lesson again and again (`replace=true`), in alternated rounds; p50 and
  p99 of the traffic.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from app.settings import BUNDLED_WEIGHTS
from bench.common import multipart, write_results
from bench.rounds import alternated, each, loaded
from harness.images import encode
from harness.records import table
from harness.server import Server
from model.shapes import SHAPE_CLASSES
from model.shapes_second import make_sample

CHUNK = 8  # the images in one of teaching's embedding requests (app.core.data_plane.TEACH_CHUNK)
MODEL = "shapes"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.heads", description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=10, help="classes in the lesson (at most 10)")
    p.add_argument("--per-class", type=int, default=20, help="example images of each class")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="each loaded run")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--name", default="heads-cpu")
    return p.parse_args()


def lesson(classes: int, per_class: int) -> list[tuple[str, tuple[str, bytes, str]]]:
    """`per_class` PNGs of each of the first `classes` shape classes, under the class's name."""
    found: dict[int, list[bytes]] = {label: [] for label in range(classes)}
    i = 0
    while any(len(images) < per_class for images in found.values()):
        sample = make_sample(31, i)
        i += 1
        if sample.label in found and len(found[sample.label]) < per_class:
            found[sample.label].append(encode(sample.image.convert("RGB")))
    return [
        (SHAPE_CLASSES[label], (f"{SHAPE_CLASSES[label]}{k}.png", png, "image/png"))
        for label, images in found.items()
        for k, png in enumerate(images)
    ]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def embedding_seconds(client: httpx.Client, files: list[tuple[str, tuple[str, bytes, str]]]) -> float:
    """The lesson's images through `/predict?embedding=true`, CHUNK a request, one request at a time."""
    started = time.perf_counter()
    for start in range(0, len(files), CHUNK):
        chunk = [("files", spec) for _, spec in files[start : start + CHUNK]]
        r = client.post("/predict", params={"embedding": "true", "model": MODEL}, files=chunk)
        r.raise_for_status()
    return time.perf_counter() - started


def teach_seconds(client: httpx.Client, head: str, files: list[tuple[str, tuple[str, bytes, str]]]) -> float:
    started = time.perf_counter()
    r = client.post(f"/v1/models/{MODEL}/heads/{head}", params={"replace": "true"}, files=files)
    r.raise_for_status()
    return time.perf_counter() - started


def teaching(
    url: str, files: list[tuple[str, tuple[str, bytes, str]]], stop: threading.Event, after_s: float, once: bool
) -> list[float]:
    """After `after_s`, the lesson taught once, or again and again until `stop`: each teach's seconds."""
    took: list[float] = []
    if stop.wait(after_s):
        return took
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            took.append(teach_seconds(client, "busy", files))
            if once:
                break
    return took


def main() -> None:
    args = parse_args()
    files = lesson(args.classes, args.per_class)
    probe = make_sample(32, 0).image.convert("RGB")
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = Path(folder) / f"{MODEL}.safetensors"
        shutil.copy(BUNDLED_WEIGHTS, checkpoint)
        body, content_type = multipart(encode(probe), "probe.png", "image/png")
        (Path(folder) / "probe.body").write_bytes(body)
        with Server(checkpoint, VIT_LOG_LEVEL="warning") as server, httpx.Client(base_url=server.url, timeout=120) as c:
            timing: dict[str, list[float]] = {"embedding": [], "teach": []}
            for k in range(3):  # the first teach in a process, then later ones
                timing["embedding"].append(embedding_seconds(c, files))
                timing["teach"].append(teach_seconds(c, f"timed{k}", files))
            for k in range(3):
                c.delete(f"/v1/models/{MODEL}/heads/timed{k}").raise_for_status()
            before = rss_mib(server.proc.pid)
            for k in range(10):
                c.post(f"/v1/models/{MODEL}/heads/h{k}", files=files).raise_for_status()
            after = rss_mib(server.proc.pid)
            head_bytes = sum(p.stat().st_size for p in (Path(folder) / "heads" / MODEL).glob("*.safetensors"))
            paths = {"embedding": "/predict?embedding=true", "head": "/predict?head=h0"}
            body_path = Path(folder) / "probe.body"

            def cost(kind: str) -> dict[str, Any]:
                return loaded(server, paths[kind], body_path, content_type, args.concurrency, args.seconds)

            costs = alternated(["embedding", "head"], args.rounds, cost)

            def traffic(kind: str) -> dict[str, Any]:
                if kind == "alone":
                    return loaded(server, "/predict", body_path, content_type, args.concurrency, args.seconds)
                stop = threading.Event()
                taught: list[float] = []
                # one lesson a second into the measured run (after its 2 s of warming), or lessons back to back
                once, after_s = (True, 3.0) if kind == "one lesson" else (False, 0.0)
                teacher = threading.Thread(
                    target=lambda: taught.extend(teaching(server.url, files, stop, after_s, once))
                )
                teacher.start()
                try:
                    run = loaded(server, "/predict", body_path, content_type, args.concurrency, args.seconds)
                finally:
                    stop.set()
                    teacher.join()
                return {**run, "teaches": len(taught), "teach_s": [round(t, 2) for t in taught]}

            under = alternated(["alone", "one lesson", "lessons back to back"], args.rounds, traffic)
    report = {
        "cpu_count": os.cpu_count(),
        "classes": args.classes,
        "per_class": args.per_class,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "time_to_teach": {k: [round(v, 3) for v in vs] for k, vs in timing.items()},
        "memory_mib": {"before": round(before, 1), "after_ten_heads": round(after, 1), "head_files_bytes": head_bytes},
        "cost": costs,
        "teaching_under_traffic": under,
    }
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    t = report["time_to_teach"]
    m = report["memory_mib"]
    cost, under = report["cost"], report["teaching_under_traffic"]
    cpu = {k: statistics.mean(r["cpu_us"]["server"] for r in rs) for k, rs in cost.items()}
    rate = {k: statistics.mean(r["requests_per_s"] for r in rs) for k, rs in cost.items()}
    p99 = {k: statistics.median(r["p99_ms"] for r in rs) for k, rs in under.items()}
    n = report["classes"] * report["per_class"]
    lines = [
        f"# Heads taught by example on the CPU ({report['cpu_count']} cores)",
        "",
        f"`python -m bench heads`: a copy of the bundled checkpoint served by `python -m app` (one process); a lesson "
        f"of {report['classes']} classes x {report['per_class']} PNGs of the second renderer ({n} images).",
        "",
        "## Time to teach",
        "",
        f"The lesson's images through `/predict?embedding=true`, {CHUNK} a request, against teaching the same lesson "
        "(`POST /v1/models/shapes/heads/NAME`), which embeds them the same way and then fits the head:",
        "",
        *table(
            ["", "embedding alone, s", "teaching, s", "teaching past the embedding, s"],
            [
                [label, f"{e:.2f}", f"{te:.2f}", f"{te - e:+.2f}"]
                for label, e, te in zip(
                    ["first in the process", "second", "third"], t["embedding"], t["teach"], strict=False
                )
            ],
        ),
        "",
        "## Memory",
        "",
        f"Resident memory {m['before']:.1f} MiB before ten heads and {m['after_ten_heads']:.1f} MiB after "
        f"({m['after_ten_heads'] - m['before']:+.1f} MiB); their ten files take {m['head_files_bytes']:,} bytes. The "
        "backbone is held once: a head is its matrix, applied to each batch's embeddings.",
        "",
        "## A request to a head against the backbone's embedding request",
        "",
        f"One 64 px PNG a request at concurrency {report['concurrency']}, {report['seconds']:.0f} s a run, rounds "
        "alternated:",
        "",
        *table(
            [
                "request",
                "req/s (each round)",
                "p99 ms",
                "server CPU µs per request (each round)",
                "CPU of the embedding's",
            ],
            [
                [
                    f"`{'/predict?embedding=true' if k == 'embedding' else '/predict?head=h0'}`",
                    each([r["requests_per_s"] for r in rs]),
                    each([r["p99_ms"] for r in rs]),
                    each([r["cpu_us"]["server"] for r in rs], ".0f"),
                    f"{cpu[k] / cpu['embedding']:.3f}",
                ]
                for k, rs in cost.items()
            ],
        ),
        "",
        f"A head's request: {cpu['head'] / cpu['embedding']:.3f}x the embedding request's CPU, "
        f"{rate['head'] / rate['embedding']:.3f}x its rate.",
        "",
        "## Teaching while the backbone serves",
        "",
        f"`/predict` at concurrency {report['concurrency']}: alone; with one lesson taught a second into the run; and "
        "while a client teaches the lesson again and again (`replace=true`) all through it:",
        "",
        *table(
            ["traffic", "req/s (each round)", "p50 ms", "p99 ms", "errors", "lessons taught (s each)"],
            [
                [
                    k,
                    each([r["requests_per_s"] for r in rs]),
                    each([r["p50_ms"] for r in rs]),
                    each([r["p99_ms"] for r in rs]),
                    sum(r["errors"] for r in rs),
                    "; ".join(", ".join(f"{s:.2f}" for s in r.get("teach_s", [])) or "-" for r in rs),
                ]
                for k, rs in under.items()
            ],
        ),
        "",
        f"Median p99 with one lesson taught in the run: {p99['one lesson'] / p99['alone']:.2f}x the p99 alone; with "
        f"lessons back to back all through it: {p99['lessons back to back'] / p99['alone']:.2f}x.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
