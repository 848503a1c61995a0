"""What the drift gauges of a real server do before, during and after a switch of its traffic, and a plot for the docs.

    python -m evaluation.drift [--window 200] [--phase 600]

The bundled model serves with VIT_DRIFT_WINDOW=--window. Traffic in requests of 8 images: --phase held-out
shapes (its own kind of image), then --phase crops of scikit-image's photographs, then --phase shapes again.
After every request both `vit_drift_score` gauges are read from /metrics. Writes evaluation/results/drift.json
and .md, and docs/drift.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.settings import BUNDLED_WEIGHTS
from evaluation import write_results
from harness.images import encode
from harness.server import Server
from harness.shifted import held_out_shapes, photograph_crops, skimage_photos

PLOT = Path(__file__).resolve().parent.parent / "docs" / "drift.png"


def gauges(text: str) -> dict[str, float]:
    return {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vit_drift_score" and s.labels.get("model") == "vit-shapes"
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m evaluation.drift", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--window", type=int, default=200)
    p.add_argument("--phase", type=int, default=600, help="images in each phase")
    args = p.parse_args()
    photos = photograph_crops(skimage_photos())
    phases = [
        ("shapes", [encode(held_out_shapes(i)) for i in range(args.phase)]),
        ("photographs", [encode(photos(i)) for i in range(args.phase)]),
        ("shapes again", [encode(held_out_shapes(args.phase + i)) for i in range(args.phase)]),
    ]
    series: list[dict[str, Any]] = []
    sent = 0
    with (
        Server(BUNDLED_WEIGHTS, VIT_DRIFT_WINDOW=str(args.window), VIT_MAX_FILES="8") as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        for phase, images in phases:
            for k in range(0, len(images), 8):
                files = [("files", (f"{i}.png", f, "image/png")) for i, f in enumerate(images[k : k + 8])]
                assert client.post("/predict", files=files).status_code == 200
                sent += len(files)
                series.append({"images": sent, "phase": phase, **gauges(client.get("/metrics").text)})
    report = {"window": args.window, "phase_images": args.phase, "series": series}
    ends = {phase: next(s for s in reversed(series) if s["phase"] == phase) for phase, _ in phases}
    lines = [
        "# Drift gauges through a switch of traffic",
        "",
        f"`python -m evaluation.drift --window {args.window} --phase {args.phase}`: the bundled model, "
        f"VIT_DRIFT_WINDOW={args.window}; the gauges at the end of each phase:",
        "",
        "| phase | prediction (TV distance) | embedding (mean ood score) |",
        "|---|---:|---:|",
        *(f"| {phase} | {s['prediction']:.3f} | {s['embedding']:.2f} |" for phase, s in ends.items()),
        "",
    ]
    write_results("drift", report, "\n".join(lines))
    plot(series, phases, args)
    print("\n".join(lines))


def plot(series: list[dict[str, Any]], phases: list[tuple[str, list[bytes]]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["images"] for s in series]
    fig, axes = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for ax, kind, label in (
        (axes[0], "prediction", "prediction drift\n(TV distance to the prior)"),
        (axes[1], "embedding", "embedding drift\n(mean ood score)"),
    ):
        ax.plot(x, [s[kind] for s in series], color="tab:blue")
        ax.axvspan(args.phase, 2 * args.phase, color="tab:orange", alpha=0.15, label="photographs")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right")
    axes[1].set_xlabel(f"images sent (window of the last {args.window})")
    fig.suptitle('vit_drift_score{model="vit-shapes"}: shapes, then photographs, then shapes')
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)


if __name__ == "__main__":
    main()
