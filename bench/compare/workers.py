"""Serving processes (VIT_WORKERS): throughput against one process, and what a killed process costs.

    python -m bench.compare.workers --rounds 2 --seconds 10 --concurrency 16 --name workers-cpu

Every server is `python -m app` with the bundled model on this machine's device, posting a 500x375 JPEG
to `/predict` (multipart) with `hey`:

- throughput: VIT_WORKERS=1 and VIT_WORKERS=N (--workers), in alternating rounds, with the CPU time each
  role used per request (the engine, the front-ends together, the supervisor). `--other TREE` adds
  VIT_WORKERS=N served from another checkout (`git worktree add /tmp/before COMMIT`), to weigh a change;
- a front-end killed: VIT_WORKERS=N under the same load, one front-end process sent SIGKILL a third of
  the way in. Counted: the requests that failed (non-200 answers and broken connections) and how long
  until the supervisor had a new front-end connected;
- the engine killed: the same with the engine process. Counted: the requests answered 503 or broken,
  and how long until `/health/ready` answered 200 again.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from app.settings import BUNDLED_WEIGHTS
from bench.common import multipart, sample_images, write_results
from bench.rounds import alternated, loaded, rounds_table
from harness.load import LoadResult, parse_hey, start_hey
from harness.records import commit, table
from harness.server import ROOT, Server, ServerProcess


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare.workers", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="front-end processes against one process (default 2)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0, help="seconds per load run")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--other", type=Path, help="a checkout to serve VIT_WORKERS=N from as well")
    p.add_argument("--name", default="workers-cpu", help="results file name")
    return p.parse_args()


def start(workers: int, device: str, tree: Path = ROOT) -> Server:
    server = Server(BUNDLED_WEIGHTS, None, tree=tree, VIT_WORKERS=str(workers), VIT_DEVICE=device, VIT_LOG_LEVEL="info")
    server.wait_ready(300)
    if workers > 1:
        until(lambda: len(front_ends(server)) == workers, 60)
    return server


def until(condition: Any, timeout: float) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)
    return time.monotonic() - started


def front_ends(server: ServerProcess) -> list[int]:
    pids = dict.fromkeys(int(p) for p in re.findall(r"front-end pid (\d+) connected", server.read_output()))
    return [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text()]


def engine(server: ServerProcess) -> int:
    return int(re.findall(r"engine \(pid (\d+)\) serving", server.read_output())[-1])


def load_in_background(url: str, body: Path, content_type: str, concurrency: int, seconds: float) -> Any:
    """hey started now; `.result()` waits for it and parses its report."""
    proc = start_hey(url, seconds, concurrency, body, content_type)

    class Running:
        @staticmethod
        def result() -> LoadResult:
            return parse_hey(proc.communicate()[0], concurrency, None)

    return Running


def fault(kind: str, args: argparse.Namespace, body: Path, content_type: str) -> dict[str, Any]:
    with start(args.workers, args.device) as server:
        url = server.url + "/predict"
        running = load_in_background(url, body, content_type, args.concurrency, args.seconds)
        time.sleep(args.seconds / 3)
        victim = front_ends(server)[0] if kind == "front-end" else engine(server)
        before = set(front_ends(server))
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        if kind == "front-end":
            until(lambda: len(set(front_ends(server)) - before) == 1, 30)
        else:
            unready = threading.Event()

            def ready() -> bool:
                try:
                    ok = httpx.get(server.url + "/health/ready", timeout=2).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if not ok:
                    unready.set()
                return ok and unready.is_set()

            until(ready, 120)
        back_after = time.monotonic() - killed
        result = running.result()
    return {
        "killed": kind,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "requests": result.ok + result.errors,
        "ok": result.ok,
        "failed": result.errors,
        "statuses": result.statuses,
        "back_after_s": round(back_after, 2),
    }


def main() -> None:
    args = parse_args()
    data, content_type = multipart(sample_images()["jpeg-medium"], "photo.jpg", "image/jpeg")
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "request.body"
        body.write_bytes(data)
        servers = {"1": (1, ROOT), str(args.workers): (args.workers, ROOT)}
        if args.other is not None:
            servers[f"{args.workers}, {commit(args.other)}"] = (args.workers, args.other)

        def run(name: str) -> dict[str, Any]:
            workers, tree = servers[name]
            with start(workers, args.device, tree) as server:
                measured = loaded(server, "/predict", body, content_type, args.concurrency, args.seconds, workers)
            print(f"VIT_WORKERS={name}: {measured}", flush=True)
            return measured

        runs = alternated(list(servers), args.rounds, run)
        faults = [fault(kind, args, body, content_type) for kind in ("front-end", "engine")]
        for f_ in faults:
            print(f_, flush=True)
    report = {
        "device": args.device,
        "image": "jpeg-medium (500x375)",
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "throughput": runs,
        "faults": faults,
    }
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    n = next(k for k in report["throughput"] if k != "1")
    lines = [
        f"# Serving processes on {report['device']}",
        "",
        f"`/predict` with one {report['image']} JPEG, concurrency {report['concurrency']}, "
        f"{report['seconds']:.0f} s per run, rounds alternating; CPU time per request answered, by role.",
        "",
        *rounds_table(report["throughput"], "VIT_WORKERS"),
        "",
        f"Faults, VIT_WORKERS={n} under the same load, SIGKILL a third of the way in:",
        "",
        *table(
            ["killed", "requests", "failed", "answers", "serving again after"],
            [
                [
                    f["killed"],
                    f["requests"],
                    f["failed"],
                    ", ".join(f"{k}: {v}" for k, v in sorted(f["statuses"].items())),
                    f"{f['back_after_s']:.1f} s",
                ]
                for f in report["faults"]
            ],
        ),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
