"""Where JPEGs are decoded, on the device stand-in: fixed shares on the host's cores against the share auto finds.

    python -m bench stand_in --shares 0 0.25 0.5 0.75 1 auto --model vit-b16 --workers 2 --seconds 8 --repeats 2
    python -m bench stand_in --shares 0 0.25 0.5 0.75 1 auto --model vit-s16 --workers 2 --slower 20

The service over the stand-in (`harness.stand_in`) with VIT_WORKERS the first `--workers` value, its device
`--slower` times as long as the H200's, loaded with `hey` over V2 (eight 500x375 JPEGs a request, 16 at once) at
each VIT_CPU_DECODE_SHARE in turn (the shares alternating over `--repeats` rounds, `bench.rounds`); auto first
settles for `--settle` seconds under the same load, then is measured as the others, and the share it chose is read
from /metrics. The host's decoding is real CPU work on this machine's cores, so the split is measured, not
modelled: only the device's times are stand-ins.

By default `--slower` makes this machine's cores stand to the stand-in as a 16-core GPU host's to the H200: the one-core
PIL rate of the same JPEG here and there (`bench.stand_in.pil_one_core_rate`, the H100 host's 211 img/s) times the
cores. The projection is then the served img/s times `--slower`: what the H200 would serve beside such a host,
decoding as measured here. It is a projection of the split, not a GPU measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import RESULTS
from bench.gpu.serving import bodies
from bench.rounds import alternated, loaded
from bench.stand_in import H100_HOST_CORES, H100_PIL_ONE_CORE, pil_one_core_rate
from harness import records
from harness.load import cpu_decode_share
from harness.models import stand_in_checkpoint
from harness.records import table
from harness.stand_in import RAW_IMAGES_PER_S, stand_in_server

CONCURRENCY = 16  # hey's workers, eight images each: 128 in flight


def host_scaled_slower() -> tuple[float, float]:
    """How much slower than the H200 the stand-in runs so that this machine's cores stand to it as a 16-core GPU
    host's to the H200 (PIL's one-core rate of the same JPEG, times the cores); and that rate here."""
    here = pil_one_core_rate()
    return H100_HOST_CORES * H100_PIL_ONE_CORE / (here * (os.cpu_count() or 1)), here


def run(args: argparse.Namespace) -> None:
    """The sweep, then its table (and results under `--json`, default bench/results/stand-in-shares-MODEL.json)."""
    slower, pil_here = (args.slower, None) if args.slower else host_scaled_slower()
    workers = args.workers[0]
    print(f"the stand-in {slower:.1f} times slower than the H200", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        weights = stand_in_checkpoint(folder / "m.safetensors")
        _, headers = bodies(folder, 8)

        def measured(share: str) -> dict[str, Any]:
            env = {"VIT_CPU_DECODE_SHARE": share, "VIT_WORKERS": str(workers)}
            with stand_in_server(weights, args.model, slower, **env) as server:
                warm = args.settle if share == "auto" else 2.0
                m = loaded(
                    server,
                    "/v2/models/m/infer",
                    folder / "v2",
                    "application/octet-stream",
                    CONCURRENCY,
                    args.seconds,
                    workers,
                    warm,
                    headers,
                )
                chosen = cpu_decode_share(server.url)
            row = {"share": share, "served_img_s": round(m["requests_per_s"] * 8, 1), "errors": m["errors"]}
            row |= {"p99_ms": m["p99_ms"], "chosen_share": chosen}
            print(row, flush=True)
            return row

        runs = alternated(args.shares, args.repeats, measured)
    rows = summary(runs, slower, args.model)
    target = args.json or RESULTS / f"stand-in-shares-{args.model}.json"
    settings = {"slower": round(slower, 2), "model": args.model, "workers": workers, "seconds": args.seconds}
    settings |= {"settle_s": args.settle, "concurrency": CONCURRENCY, "images_per_request": 8}
    settings |= {"pil_one_core_here_img_s": pil_here and round(pil_here, 1)}
    records.write_results(target.parent, target.stem, {"settings": settings, "rows": rows, "runs": runs}, report(rows))


def summary(runs: dict[str, list[dict[str, Any]]], slower: float, model: str) -> list[dict[str, Any]]:
    """A row per share: median img/s here, projected (times `slower`) and as a share of the raw forward; auto's
    beside the best fixed share's."""
    rows = []
    for share, measured in runs.items():
        served = statistics.median(r["served_img_s"] for r in measured)
        row = {"share": share, "served_img_s": round(served, 1), "projected_img_s": round(served * slower)}
        row |= {"of_raw": round(served * slower / RAW_IMAGES_PER_S[model], 3), "runs": len(measured)}
        row |= {"p99_ms": statistics.median(r["p99_ms"] for r in measured)}
        if share == "auto":
            row["chosen_share"] = [r["chosen_share"] for r in measured]
        rows.append(row)
    fixed = [r for r in rows if r["share"] != "auto"]
    best = max(fixed, key=lambda r: r["served_img_s"]) if fixed else None
    for row in rows:
        row["of_best_fixed"] = round(row["served_img_s"] / best["served_img_s"], 3) if best else None
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    fixed = [r for r in rows if r["share"] != "auto"]
    best = max(fixed, key=lambda r: r["served_img_s"])
    lines = [
        "# Where JPEGs are decoded, on the device stand-in: fixed shares and auto",
        "",
        "`python -m bench stand_in --shares ...` (bench/stand_in_shares.py). Median of the rounds; the projection is "
        "the served img/s times how much slower the stand-in ran (see the settings).",
        "",
        *table(
            [
                "VIT_CPU_DECODE_SHARE",
                "served here img/s",
                "p99 ms",
                "projected img/s",
                "of raw",
                "of the best fixed",
                "share auto chose",
            ],
            [
                (
                    r["share"],
                    f"{r['served_img_s']:.0f}",
                    f"{r['p99_ms']:.0f}",
                    f"{r['projected_img_s']:,}",
                    f"{r['of_raw']:.2f}",
                    f"{r['of_best_fixed']:.2f}",
                    ", ".join(f"{c:.2f}" for c in r.get("chosen_share", [])),
                )
                for r in rows
            ],
        ),
        "",
        f"The best fixed share: {best['share']} ({best['served_img_s']:.0f} img/s here).",
    ]
    return "\n".join(lines) + "\n"
