"""Does CPU work stall the event loop? `GET /health/live` latency while clients ask for overlays of large photos.

    python -m bench.liveness --rounds 2 --name liveness                 # this tree
    python -m bench.liveness --rounds 2 --other /tmp/old --name ab      # A/B against another checkout
    python -m bench.liveness --rounds 4 --other /tmp/old --throughput-only --name ab-c32
    python -m bench.liveness --rounds 4 --other /tmp/old --throughput-only --weights W.safetensors  # one model

One uvicorn process per measurement (bundled model, the default backend). For each tree, in
alternating rounds: `/health/live` alone, then beside 4 clients posting a 1600x1200 JPEG with
`attention=rollout&overlay=true`, then beside the same load without `overlay`; and the throughput of
`POST /predict` (multipart, a 64 px PNG) at concurrency 32. A loop that runs CPU work shows it as
health-check latency: every request waits behind it.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from app.settings import BUNDLED_WEIGHTS
from bench.common import multipart, sample_images, write_results
from bench.trees import alternated
from harness.load import LoadResult, parse_hey, require_hey, run_hey
from harness.records import table
from harness.server import ROOT, ServerProcess, free_port


def large_photo() -> bytes:
    """A 1600x1200 JPEG with gradients and noise, as a phone photo costs to decode."""
    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:1200, 0:1600]
    pixels = np.stack([(xs * 0.3) % 256, (ys * 0.4) % 256, ((xs + ys) * 0.2) % 256], -1) + rng.normal(
        0, 10, (1200, 1600, 3)
    )
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def start(tree: Path, weights: Path | None) -> ServerProcess:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "app.main:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    env = {
        # by default each tree's own bundled model: older code may read only its own
        "VIT_WEIGHTS": str(weights or tree / "weights" / BUNDLED_WEIGHTS.name),
        "VIT_DEVICE": "cpu",
        "VIT_THREADS": "1",
        "VIT_LOG_LEVEL": "warning",
        "VIT_MAX_QUEUE": "4096",
    }
    server = ServerProcess(argv, env, port, cwd=tree)
    server.wait_ready(180)
    return server


def health_p99(url: str, seconds: float) -> LoadResult:
    """One client checking liveness 50 times a second."""
    out = subprocess.run(
        [require_hey(), "-z", f"{seconds}s", "-c", "1", "-q", "50", url + "/health/live"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_hey(out, 1, None)


def health_under(url: str, path: str, body: Path, seconds: float) -> tuple[LoadResult, LoadResult]:
    """(liveness, load) while 4 clients post `body` to `path`."""
    load: list[LoadResult] = []
    worker = threading.Thread(target=lambda: load.append(run_hey(url + path, body, "image/jpeg", 4, seconds + 2)))
    worker.start()
    health = health_p99(url, seconds)
    worker.join()
    return health, load[0]


def measure(
    tree: Path, weights: Path | None, photo: Path, form: Path, form_type: str, seconds: float, health: bool
) -> dict[str, Any]:
    server = start(tree, weights)
    if not health:
        try:
            c32 = run_hey(server.url + "/predict", form, form_type, 32, seconds)
        finally:
            server.stop()
        return {"c32_req_s": c32.requests_per_s, "c32_p99_ms": c32.p99_ms, "errors": c32.errors}
    try:
        idle = health_p99(server.url, seconds)
        overlay, overlay_load = health_under(server.url, "/predict?attention=rollout&overlay=true", photo, seconds)
        plain, plain_load = health_under(server.url, "/predict?attention=rollout", photo, seconds)
        c32 = run_hey(server.url + "/predict", form, form_type, 32, seconds)
    finally:
        server.stop()
    return {
        "health_p99_ms": {"idle": idle.p99_ms, "overlay": overlay.p99_ms, "rollout": plain.p99_ms},
        "health_p50_ms": {"idle": idle.p50_ms, "overlay": overlay.p50_ms, "rollout": plain.p50_ms},
        "load_req_s": {"overlay": overlay_load.requests_per_s, "rollout": plain_load.requests_per_s},
        "c32_req_s": c32.requests_per_s,
        "c32_p99_ms": c32.p99_ms,
        "errors": overlay_load.errors + plain_load.errors + c32.errors,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.liveness", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=15.0, help="seconds per measurement")
    p.add_argument("--other", type=Path, help="another checkout to measure in alternating rounds (A/B)")
    p.add_argument("--this", type=Path, default=ROOT, help="the checkout measured as 'this' (default: this one)")
    p.add_argument("--weights", type=Path, help="one checkpoint every tree serves (default: each tree's own)")
    p.add_argument("--throughput-only", action="store_true", help="only /predict at concurrency 32")
    p.add_argument("--name", default="liveness")
    args = p.parse_args()
    trees = {"this": args.this.resolve()} | ({"other": args.other.resolve()} if args.other else {})
    with tempfile.TemporaryDirectory() as tmp:
        photo, form = Path(tmp) / "photo.jpg", Path(tmp) / "form"
        photo.write_bytes(large_photo())
        body, form_type = multipart(sample_images()["png-small"], "image.png", "image/png")
        form.write_bytes(body)

        def run(tree: Path) -> dict[str, Any]:
            result = measure(tree, args.weights, photo, form, form_type, args.seconds, not args.throughput_only)
            print(f"{tree}: {json.dumps(result)}", flush=True)
            return result

        by_path = alternated(list(trees.values()), args.rounds, run)
        runs = {name: by_path[str(tree)] for name, tree in trees.items()}
    report = {
        "trees": {k: str(v) for k, v in trees.items()},
        "weights": str(args.weights or "each tree's own"),
        "runs": runs,
    }
    write_results(args.name, report, markdown(runs, trees))
    print(markdown(runs, trees))


def markdown(runs: dict[str, list[dict[str, Any]]], trees: dict[str, Path]) -> str:
    if "health_p99_ms" not in next(iter(runs.values()))[0]:
        rows = [
            [f"{name} ({trees[name].name})", i + 1, f"{r['c32_req_s']:.1f}", f"{r['c32_p99_ms']:.1f}", r["errors"]]
            for name, results in runs.items()
            for i, r in enumerate(results)
        ]
        means = [f"{name}: mean {sum(r['c32_req_s'] for r in rs) / len(rs):.1f} req/s" for name, rs in runs.items()]
        header = ["tree", "round", "c=32 req/s", "p99 ms", "errors"]
        return "\n".join([*table(header, rows), "", "; ".join(means)]) + "\n"
    lines = [
        "`GET /health/live` p99 (p50) in ms: idle, beside 4 clients asking for rollout + overlay of a 1600x1200 JPEG, "
        "and beside the same load without overlay; then /predict throughput at concurrency 32 (64 px PNG, multipart).",
        "",
    ]
    rows = []
    for name, results in runs.items():
        for i, r in enumerate(results):
            h, m = r["health_p99_ms"], r["health_p50_ms"]
            rows.append(
                [f"{name} ({trees[name].name})", i + 1]
                + [f"{h[k]:.1f} ({m[k]:.1f})" for k in ("idle", "overlay", "rollout")]
                + [f"{r['load_req_s']['overlay']:.1f}", f"{r['c32_req_s']:.1f}", f"{r['c32_p99_ms']:.1f}"]
            )
    header = ["tree", "round", "idle", "overlay load", "rollout load", "overlay load req/s", "c=32 req/s"]
    lines += table([*header, "c=32 p99 ms"], rows)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
