"""The batch runner against the raw forward rate and the HTTP service, on the same JPEG files, in one run.

    python -m bench.batch --name batch-cpu
    python -m bench.batch --models vit-s16 --images 320 --name batch-vit-s16

For each model (the bundled checkpoint; a random-weight ViT-S/16 at 224 px): (1) the backend's
forward pass alone on pre-made tensors at the batch size; (2) `python -m app.batch` on a folder of
distinct 500x375 JPEGs, single process; (3) the same job with `--ray` on a local Ray (started by the
job; its start-up is counted, and also timed alone); (4) the HTTP service fed the same kind of JPEG
by `hey` at concurrency 2 x batch. Rates are images/s; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from app.settings import BUNDLED_WEIGHTS
from bench.common import write_results
from bench.limits import forward_throughput
from harness.images import photo_jpeg
from harness.load import require_hey, run_hey, start_service
from harness.models import vit_s16_checkpoint
from harness.records import table
from harness.server import ROOT
from model.checkpoint import load_checkpoint


def run_batch(
    folder: Path, output: Path, checkpoint: Path, batch_size: int, threads: int, ray: bool
) -> dict[str, float]:
    argv = [
        sys.executable,
        "-m",
        "app.batch",
        str(folder),
        "--output",
        str(output),
        "--checkpoint",
        str(checkpoint),
        "--batch-size",
        str(batch_size),
        "--threads",
        str(threads),
        *(["--ray"] if ray else []),
    ]
    started = time.perf_counter()
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"app.batch failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = {"wall_s": wall}
    found = re.search(r"(\d+) images classified in ([\d.]+) s \(([\d.]+) images/s\)", out.stderr)
    if found:  # the single-process runner times its own classify phase (after the model is loaded)
        result |= {"images": float(found.group(1)), "classify_s": float(found.group(2))}
    return result


def ray_start_seconds() -> float:
    code = "import time, ray; t = time.perf_counter(); ray.init(); print(time.perf_counter() - t); ray.shutdown()"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def measure(
    name: str, checkpoint: Path, folder: Path, n: int, batch: int, threads: int, seconds: float
) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    ckpt = load_checkpoint(checkpoint)
    device = torch.device("cpu")
    raw = max(r.images_per_s for r in forward_throughput(ckpt, device, batch, "onnxruntime") if r.batch_size == batch)
    del ckpt
    print(f"{name}: raw forward {raw:.1f} img/s at batch {batch}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        single = run_batch(folder, Path(tmp) / "rows.jsonl", checkpoint, batch, threads, ray=False)
        print(f"{name}: runner {single}", flush=True)
        on_ray = run_batch(folder, Path(tmp) / "shards.parquet", checkpoint, batch, threads, ray=True)
        print(f"{name}: ray {on_ray}", flush=True)
    body = next(folder.iterdir())
    server = start_service(checkpoint, batch, 5.0, threads, "onnxruntime")
    try:
        load = run_hey(server.url + "/predict", body, "image/jpeg", 2 * batch, seconds)
    finally:
        server.stop()
    print(
        f"{name}: service {load.requests_per_s:.1f} req/s, p99 {load.p99_ms:.0f} ms, errors {load.errors}", flush=True
    )
    runner_rate = single["images"] / single["classify_s"]
    return {
        "images": n,
        "batch_size": batch,
        "threads": threads,
        "raw_images_per_s": raw,
        "runner": single | {"images_per_s": runner_rate, "end_to_end_images_per_s": n / single["wall_s"]},
        "ray": on_ray | {"end_to_end_images_per_s": n / on_ray["wall_s"]},
        "service_images_per_s": load.requests_per_s,
        "service_p99_ms": load.p99_ms,
        "service_errors": load.errors,
        "runner_vs_raw": runner_rate / raw,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=["bundled", "vit-s16"], default=["bundled", "vit-s16"])
    p.add_argument("--images", type=int, default=0, help="JPEG files per model (default: 600 bundled, 320 ViT-S/16)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch and ONNX Runtime threads (0: all cores)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of hey against the service")
    p.add_argument("--name", default="batch-cpu")
    args = p.parse_args()
    require_hey()
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": torch.get_num_threads(),
        "ray_start_s": ray_start_seconds(),
        "models": {},
    }
    print(f"ray.init() alone: {report['ray_start_s']:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            n = args.images or (600 if name == "bundled" else 320)
            folder = Path(tmp) / f"images-{name}"
            folder.mkdir()
            for i in range(n):
                (folder / f"{i:05d}.jpg").write_bytes(photo_jpeg(i))
            checkpoint = BUNDLED_WEIGHTS if name == "bundled" else vit_s16_checkpoint(Path(tmp) / "vit-s16.safetensors")
            report["models"][name] = measure(name, checkpoint, folder, n, args.batch_size, args.threads, args.duration)
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Started {report['started']}, {report['cpus']} CPU threads; `ray.init()` alone took {report['ray_start_s']:.1f} s. "
        "Images/s on distinct 500x375 JPEGs; the runner's own rate excludes loading the model, end-to-end includes "
        "the process start, the model load (and ONNX export) and, for Ray, starting Ray.",
        "",
        *table(
            [
                "model",
                "images",
                "raw forward",
                "runner",
                "runner end-to-end",
                "Ray end-to-end",
                "service (hey)",
                "runner / raw",
            ],
            [
                [
                    name,
                    m["images"],
                    f"{m['raw_images_per_s']:.1f}",
                    f"{m['runner']['images_per_s']:.1f}",
                    f"{m['runner']['end_to_end_images_per_s']:.1f}",
                    f"{m['ray']['end_to_end_images_per_s']:.1f}",
                    f"{m['service_images_per_s']:.1f}",
                    f"{m['runner_vs_raw']:.2f}",
                ]
                for name, m in report["models"].items()
            ],
        ),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
