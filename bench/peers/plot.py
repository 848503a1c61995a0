"""The comparison as a picture: req/s and p99 against concurrency, one line per server, one row per model and image.

python -m bench.peers.plot bench/results/peers-cpu.json docs/peers.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import sample_label
from bench.peers.summary import summary

# the service's lanes drawn solid and thick; the peers thin and dashed
STYLE = {
    "service /predict": ("black", "-", 2.4),
    "service V2": ("tab:gray", "-", 2.4),
    "service /predict, torch": ("black", ":", 2.0),
}


def draw(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    panels = [(m, image) for m in report["models"].values() for image in m["images"]]
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.4 * len(panels)), squeeze=False)
    colours = iter(plt.get_cmap("tab10").colors)
    lane_colour: dict[str, Any] = {}
    for row, (model, image) in zip(axes, panels, strict=True):
        levels = model["concurrency"]
        for lane, by_image in model["runs"].items():
            runs = by_image.get(image, {})
            xs = [c for c in levels if str(c) in runs or c in runs]
            if not xs:
                continue
            at = [runs.get(str(c)) or runs[c] for c in xs]
            colour, dash, width = STYLE.get(lane, (None, "--", 1.3))
            if colour is None:
                if lane not in lane_colour:
                    lane_colour[lane] = next(colours)
                colour = lane_colour[lane]
            for ax, key in ((row[0], "requests_per_s"), (row[1], "p99_ms")):
                ys = [summary(rs)[key] for rs in at]
                ax.plot(xs, ys, dash, color=colour, linewidth=width, marker="o", markersize=3, label=lane)
        title = f"{model['model']}, {sample_label(image)}"
        for ax, label in ((row[0], "req/s"), (row[1], "p99 ms")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(label)
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
        row[1].set_yscale("log")
        row[1].yaxis.set_major_formatter(ticker.ScalarFormatter())
        row[1].yaxis.set_minor_formatter(ticker.NullFormatter())
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.4 * len(panels))))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peers.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a results file of python -m bench peers")
    p.add_argument("out", type=Path, help="the PNG to write")
    args = p.parse_args()
    draw(json.loads(args.results.read_text()), args.out)


if __name__ == "__main__":
    main()
