"""What a request costs the HTTP app itself: ASGI calls in process, no server, no socket, no load generator.

    python -m bench.compare.app_cost --trees . /tmp/before --repeats 3

On this shared 2-core machine a load test's figures move by 10 % and more from run to run, too much to
see a change of a few percent in the route's own work. This calls the app (`create_app` over a running
engine: the bundled model on the CPU, a 64 MiB response cache) straight through ASGI, one request at a
time, and times its CPU per request:
- `/predict` answered from the cache: a 500x375 JPEG, multipart, computed once before the timing;
- `GET /health/live`;
- the same upload posted to a path with no route (404): the app's share of taking an upload in.

Each tree (a checkout, `git worktree add /tmp/before REV`) runs in its own process with its own code, the
trees alternating `--repeats` times; each run times `--rounds` rounds of `--calls` requests per route.
The best round is the figure least touched by whatever else the machine runs; the median is beside it.
Beside each route, the garbage collector's time per request (every collection the requests set off, timed by
its callbacks; a full collection is rare and long, so its mean over many requests is the figure to read). With
`--freeze-heap`, everything alive once the app is built and warm is frozen first
(`gc.freeze()`), as a serving front-end and the engine process freeze theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROUTES = {"cache hit": "/predict", "health": "/health/live", "upload answered 404": "/no-such-route"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare.app_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", type=Path, nargs="+", default=[Path(".")], help="checkouts to compare")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tree, alternating")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--name", default="app-cost-cpu")
    p.add_argument(
        "--freeze-heap", action="store_true", help="freeze the heap once the app is warm, as a front-end does"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(measure(args.rounds, args.calls, args.freeze_heap))))
        return
    from bench.trees import alternated  # the parent only: a worker imports nothing of this tree

    trees = [t.resolve() for t in args.trees]

    def run(tree: Path) -> dict[str, list[float]]:
        rounds = worker(tree, args.rounds, args.calls, args.freeze_heap)
        print(tree, {label: round(min(v)) for label, v in rounds.items()}, flush=True)
        return rounds

    rounds: dict[str, dict[str, list[float]]] = {
        tree: {label: [v for r in runs for v in r[label]] for label in runs[0]}
        for tree, runs in alternated(trees, args.repeats, run).items()
    }
    from bench.common import write_results  # the parent only: a worker imports nothing of this tree
    from harness.records import commit

    report = {
        "cpu_count": os.cpu_count(),
        "repeats": args.repeats,
        "rounds": args.rounds,
        "calls": args.calls,
        "freeze_heap": args.freeze_heap,
        "trees": {str(t): commit(t) for t in trees},
        "us_per_request": rounds,
    }
    write_results(args.name, report, markdown(report))


def worker(tree: Path, rounds: int, calls: int, freeze_heap: bool) -> dict[str, list[float]]:
    """One run in `tree`'s code: this file run as a script there, so that `app` is that tree's."""
    command = [sys.executable, __file__, "--worker", "--rounds", str(rounds), "--calls", str(calls)]
    command += ["--freeze-heap"] if freeze_heap else []
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    result: dict[str, list[float]] = json.loads(out.strip().splitlines()[-1])
    return result


async def measure(rounds: int, calls: int, freeze_heap: bool) -> dict[str, list[float]]:
    try:
        from app.core.engine.engine import Engine
    except ImportError:  # a tree before the core's rooms (1c251d3)
        from app.core.engine import Engine  # type: ignore[no-redef]
    from app.settings import BUNDLED_WEIGHTS, Settings
    from app.web.app import create_app

    settings = Settings(weights=BUNDLED_WEIGHTS, device="cpu", backend="torch", cache_bytes=64 * 2**20)
    body, content_type = upload()
    requests = {
        "cache hit": ("POST", "/predict", body, content_type),
        "health": ("GET", "/health/live", b"", ""),
        "upload answered 404": ("POST", "/no-such-route", body, content_type),
    }
    async with Engine.serving(settings) as engine:
        app = create_app(engine)
        expected = {"cache hit": 200, "health": 200, "upload answered 404": 404}
        for label, asked in requests.items():  # the first /predict fills the cache
            status = await call(app, *asked)
            assert status == expected[label], (label, status)
        if freeze_heap:
            gc.collect()
            gc.freeze()
        collecting = Collections()
        times: dict[str, list[float]] = {label: [] for label in [*requests, *(f"{r}: collector" for r in requests)]}
        for _ in range(rounds):
            for label, asked in requests.items():
                collecting.seconds = 0.0
                started = time.process_time()
                for _ in range(calls):
                    await call(app, *asked)
                times[label].append((time.process_time() - started) / calls * 1e6)
                times[f"{label}: collector"].append(collecting.seconds / calls * 1e6)
        collecting.stop()
    return times


class Collections:
    """The garbage collector's time, summed over its collections from now on."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.started = 0.0
        gc.callbacks.append(self.on_gc)

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self.started

    def stop(self) -> None:
        gc.callbacks.remove(self.on_gc)


def upload() -> tuple[bytes, str]:
    """A 500x375 JPEG as multipart field `file`, as bench.cache posts them."""
    from model.shapes import make_sample

    buf = io.BytesIO()
    make_sample(9000, 0).image.resize((500, 375)).save(buf, format="JPEG", quality=90)
    boundary = uuid.uuid4().hex
    head = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="photo.jpg"\r\n'
    head += "Content-Type: image/jpeg\r\n\r\n"
    body = head.encode() + buf.getvalue() + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


async def call(app: Any, method: str, path: str, body: bytes, content_type: str) -> int:
    """One request through the app's ASGI interface; its status."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays: no disconnect
        raise AssertionError

    status = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    headers = [(b"host", b"bench"), (b"content-length", str(len(body)).encode())]
    if content_type:
        headers.append((b"content-type", content_type.encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    await app(scope, receive, send)
    return status


def markdown(report: dict[str, Any]) -> str:
    from harness.records import table

    rows = []
    for tree, routes in report["us_per_request"].items():
        health = min(routes["health"])
        for label, values in routes.items():
            rows.append(
                [
                    report["trees"][tree],
                    label,
                    f"{min(values):.0f}",
                    f"{statistics.median(values):.0f}",
                    f"{statistics.mean(values):.0f}",
                    f"{min(values) / health:.2f}",
                ]
            )
    return "\n".join(
        [
            f"# What a request costs the HTTP app itself ({report['cpu_count']} cores)",
            "",
            f"`python -m bench.compare.app_cost`: ASGI calls in process, one at a time, the bundled model on the CPU "
            f"with a 64 MiB cache; each tree run {report['repeats']} times, alternating, each run "
            f"{report['rounds']} rounds of {report['calls']} requests per route. CPU time per request; *collector*: "
            "the garbage collector's time per request, within it"
            + (", the heap frozen once the app was warm (`--freeze-heap`)." if report.get("freeze_heap") else "."),
            "",
            *table(["tree", "request", "best round, µs", "median round, µs", "mean, µs", "best / health"], rows),
            "",
        ]
    )


if __name__ == "__main__":
    main()
