"""How long the service takes to become ready, with and without the ONNX graph cache (VIT_ONNX_CACHE).

    python -m bench.startup --name startup-cpu

For the bundled checkpoint and a ViT-S/16 (random weights), on each ONNX backend: seconds from the
process's start to `/health/ready` answering 200 with the cache off, with an empty cache (the first
start, which exports and fills it), and with the filled cache (a restart). Warm-up is on, as by default.
Writes bench/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from app.settings import BUNDLED_WEIGHTS
from bench.common import write_results
from harness.models import vit_s16_checkpoint
from harness.records import table
from harness.server import Server

STARTS = ["cache off", "empty cache", "filled cache"]


def seconds_to_ready(checkpoint: Path, backend: str, cache: str) -> float:
    started = time.perf_counter()
    server = Server(checkpoint, VIT_LOG_LEVEL="warning", VIT_BACKEND=backend, VIT_ONNX_CACHE=cache)
    try:
        server.wait_ready(600)
        return time.perf_counter() - started
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="startup-cpu")
    parser.add_argument("--backends", nargs="+", default=["onnxruntime", "onnxruntime-int8"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"bundled": BUNDLED_WEIGHTS, "ViT-S/16": vit_s16_checkpoint(Path(tmp) / "vit-s16.safetensors")}
        for model, checkpoint in models.items():
            for backend in args.backends:
                cache = Path(tmp) / f"cache-{model.replace('/', '')}-{backend}"
                row: dict[str, object] = {"model": model, "backend": backend}
                for start in STARTS:
                    row[start] = seconds_to_ready(checkpoint, backend, "" if start == "cache off" else str(cache))
                    print(f"{model:<9} {backend:<17} {start:<13} {row[start]:6.1f} s", flush=True)
                rows.append(row)
    report = {"machine": platform.processor() or platform.machine(), "rows": rows}
    write_results(args.name, report, markdown(report, args.name))


def markdown(report: dict[str, Any], name: str) -> str:
    rows = [[r["model"], f"`{r['backend']}`", *(f"{r[s]:.1f}" for s in STARTS)] for r in report["rows"]]
    lines = [
        "# Seconds to ready, with and without the ONNX graph cache",
        "",
        f"`python -m bench.startup --name {name}`",
        "",
        *table(["model", "backend", *STARTS], rows, "ll" + "r" * len(STARTS)),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
