"""Models changed under load: nothing lost, and no memory kept.

    python -m bench.reload --name reload-cpu

(1) Reload under load: `hey` at concurrency 32 on `/predict` while the served checkpoint file is
replaced (written beside it, renamed over it) `--reloads` times in poll mode, alternating between two
versions; a second client reads the version of each of its own answers. (2) Load and unload a second
model `--cycles` times through the repository API while `hey` serves the first; the server's resident
memory after each unload. Both with the bundled model and with a random-weight ViT-S/16 (224 px),
and with the ONNX graph cache off (VIT_ONNX_CACHE=), so every load exports: the worst case. The test
suite runs the same two experiments on a tiny model (tests/e2e/test_model_changes.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.settings import BUNDLED_WEIGHTS
from bench.common import write_results
from harness.images import encode
from harness.model_changes import another_version, load_unload_cycles, reload_under_load
from harness.models import vit_s16_checkpoint
from harness.records import table
from model.shapes import make_sample


def report(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for key, r in results.items():
        if key.startswith("reload/"):
            switch = sorted(r["switch_s"])
            rows.append(
                [
                    key.removeprefix("reload/"),
                    r["reloads"],
                    r["hey"]["ok"],
                    r["hey"]["errors"],
                    f"{r['hey']['requests_per_s']:.1f}",
                    r["checked"]["versions"],
                    sorted(set(r["after_last"])),
                    f"{switch[len(switch) // 2]:.2f}, {switch[-1]:.2f}",
                ]
            )
    header = ["model", "reloads", "hey 200", "hey errors", "hey req/s", "checker answers by version", "after the last"]
    lines = table([*header, "switch s (median, max)"], rows, "lrrrrlll")
    for key, r in results.items():
        if key.startswith("cycles/"):
            rss = r["rss_mib"]
            lines += [
                "",
                f"Load and unload {key.removeprefix('cycles/')} {r['cycles']} times while the bundled model serves "
                f"(`hey` c=4: {r['hey']['ok']} answers, {r['hey']['errors']} errors): resident memory {r['rss_before_mib']:.0f} MiB "
                "before the first load, after each unload "
                f"{', '.join(f'{x:.0f}' for x in rss)} MiB (last - first: {rss[-1] - rss[0]:+.1f} MiB); "
                f"load {min(r['load_s']):.2f}-{max(r['load_s']):.2f} s.",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="reload-cpu")
    p.add_argument("--reloads", type=int, default=10)
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work)
        image = folder / "image.png"
        image.write_bytes(encode(make_sample(1, 0).image))
        bundled_b = another_version(BUNDLED_WEIGHTS, folder / "bundled-b.safetensors")
        vit_a = vit_s16_checkpoint(folder / "vit-s16-a.safetensors", seed=0)
        vit_b = vit_s16_checkpoint(folder / "vit-s16-b.safetensors", seed=1)
        for label, pair in [("bundled", (BUNDLED_WEIGHTS, bundled_b)), ("vit-s16", (vit_a, vit_b))]:
            print(f"reload under load: {label}", flush=True)
            results[f"reload/{label}"] = asdict(
                reload_under_load(pair, image, args.reloads, args.concurrency, VIT_ONNX_CACHE="")
            )
            print(json.dumps(results[f"reload/{label}"]), flush=True)
        print("load and unload ViT-S/16 while the bundled model serves", flush=True)
        results["cycles/vit-s16"] = asdict(
            load_unload_cycles(BUNDLED_WEIGHTS, vit_a, image, args.cycles, 4, VIT_ONNX_CACHE="")
        )
        print(json.dumps(results["cycles/vit-s16"]), flush=True)
    write_results(args.name, results, f"# {args.name}\n\n{report(results)}")


if __name__ == "__main__":
    main()
