"""The stand-in's projections against what a GPU host served: rows of `python -m bench.stand_in` projected again
with that run's own device rates and its host's cores, beside the rates it measured.

    git show 18e3d3d:bench/results/stand-in-cpu.json > /tmp/h200-era.json
    git show 18e3d3d:bench/results/gpu-h200.json > /tmp/gpu-h200.json
    python -m bench.stand_in_calibration /tmp/h200-era.json --gpu /tmp/gpu-h200.json --name stand-in-calibration-h200

With `--replay-tree TREE` (a checkout of that code: `git worktree add /tmp/h200era 18e3d3d`), the engine's ceiling
comes from its CPU per image where front-ends outrun it, as `bench.stand_in --replay` takes it: `bench.compare.
engine_cost --replay` runs TREE's engine here, at the route's images and the GPU sweep's largest load, and the figure
is scaled by this machine's one-core PIL rate, measured in the same run.

The rows should be those of the code the GPU run served (the commits just before it), so that the two measure
the same service. From the GPU run (`bench/gpu.sh run raw decode served`):
- the device: its compiled + CUDA-graph forward at batch 256 (the H100's curve over batch sizes, scaled to it:
  only the largest batch enters the projection), and its nvJPEG rate with the resize on the GPU (decoding alone
  in a run that did not time the resize), one batch's decoding after another's forward, as the stand-in runs them;
- the host: its cores, and its one-core PIL rate, which scales a microsecond measured here to one of its cores;
- the measured rate of each configuration: the best over the concurrencies it was loaded at (VIT_WORKERS=1 is
  `gpu-decode+graphs`, N front-ends `workers-N`), with its mean batch and the cores the server used.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from bench.common import RESULTS
from bench.stand_in import MAX_BATCH_SIZE, project
from harness.records import table
from harness.stand_in import FORWARD_IMAGES_PER_S, DeviceTimes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.stand_in_calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("rows", type=Path, help="a bench.stand_in results file (JSON)")
    p.add_argument("--gpu", type=Path, default=RESULTS / "gpu-h200.json", help="a bench.gpu results file (JSON)")
    p.add_argument("--name", default="stand-in-calibration-h200")
    p.add_argument("--out", type=Path, default=RESULTS, help="the folder NAME.md and NAME.json go to")
    p.add_argument("--replay-tree", type=Path, help="measure the engine of the rows' code where front-ends outrun it")
    return p.parse_args()


def device_rate(model: str, gpu: dict[str, Any]) -> float:
    """The GPU run's device rate for `model` with its CUDA decoder, as the stand-in's durations give it (one batch's
    decoding after another's forward, at batch 256)."""
    forward_256 = gpu["raw"][model]["img_per_s"]["compiled+graphs"]["256"]
    ratio = forward_256 / FORWARD_IMAGES_PER_S[model][256]
    curve = {n: rate * ratio for n, rate in FORWARD_IMAGES_PER_S[model].items()}
    times = DeviceTimes(model, MAX_BATCH_SIZE, curve, decode_rate(gpu))
    return times.images_per_s("cuda")


def decode_rate(gpu: dict[str, Any]) -> float:
    """The GPU run's nvJPEG img/s with the resize on the GPU, which the service does to each JPEG there."""
    decode: dict[str, float] = gpu["decode"]
    return decode.get("gpu_decode_resize_img_per_s", decode["gpu_decode_img_per_s"])


def measured(gpu: dict[str, Any], model: str, route: str, workers: int) -> dict[str, Any] | None:
    variant = "gpu-decode+graphs" if workers == 1 else f"workers-{workers}"
    levels = gpu["served"].get(model, {}).get(variant, {}).get(route) or []
    return max(levels, key=lambda level: level["images_per_s"], default=None)


def host_cores(gpu: dict[str, Any]) -> int:
    found = re.search(r"^(\d+)\s*(?:CPU cores|$)", gpu.get("machine", ""), re.MULTILINE)
    if not found:
        raise ValueError("the GPU run does not say how many cores its host has")
    return int(found.group(1))


def calibrated(row: dict[str, Any], gpu: dict[str, Any]) -> dict[str, Any] | None:
    """One stand-in row projected onto the GPU run's host and device, beside what that host served."""
    served = measured(gpu, row["model"], row["route"], row["workers"])
    if row["server"] != "vit-serve" or served is None:
        return None
    pil = gpu["decode"]["cpu_img_per_s"]["1"]
    scale = row["pil_one_core_here_img_s"] / pil
    per_image = {  # the engine where front-ends outrun it, where the row measured that (`bench.stand_in --replay`)
        "engine": row.get("engine_replayed_cpu_us_per_image", row["engine_cpu_us_per_image"]),
        "front-ends": row["frontend_cpu_us_per_image"],
        "supervisor": row["supervisor_cpu_us_per_image"],
        "load generator": row["load_generator_cpu_us_per_image"],
    }
    # with --replay-tree: at most what this checkout's engine served over the stand-in's device, which waits for the
    # H200 run's durations (the device as the engine's batching attains it)
    device = min(device_rate(row["model"], gpu), row.get("device_replayed_img_s", float("inf")))
    # the GPU run served with nvJPEG, the CUDA decoder: its rate stands for both decoders' (the JPEG engines' column
    # of `project` is not used here)
    projection = project(row["model"], row["workers"], per_image, scale, (device, device), host_cores(gpu))
    bound = min(
        ("device", device),
        ("engine", projection["engine_ceiling_img_s"]),
        ("front-ends", projection["frontend_ceiling_img_s"]),
        key=lambda b: b[1],
    )[0]
    # the serving processes' CPU per image, in the GPU host's microseconds: the stand-in's (its roles together), and
    # what that host's processes spent (their cores over the rate they served)
    server_us = sum(per_image[role] for role in ("engine", "front-ends", "supervisor")) * scale
    there_us = served["server_cores"] * 1e6 / served["images_per_s"]
    return {
        "model": row["model"],
        "route": row["route"],
        "workers": row["workers"],
        "commit": row["commit"],
        "core_scale": round(scale, 3),
        "engine_host_us_per_image": round(per_image["engine"] * scale, 1),
        "engine_replayed": "engine_replayed_cpu_us_per_image" in row,
        "mean_batch_here": row["mean_batch"],
        "device_img_s": round(device, 1),
        "engine_ceiling_img_s": round(projection["engine_ceiling_img_s"], 1),
        "frontend_ceiling_img_s": round(projection["frontend_ceiling_img_s"], 1),
        "projected_img_s": round(projection["projected_img_s"], 1),
        "bound_by": bound,
        "measured_img_s": round(served["images_per_s"], 1),
        "measured_concurrency": served["concurrency"],
        "measured_mean_batch": round(served["mean_batch_size"], 1),
        "measured_server_cores": round(served["server_cores"], 1),
        "measured_over_projected": round(served["images_per_s"] / projection["projected_img_s"], 2),
        "server_host_us_per_image": round(server_us, 1),
        "measured_server_us_per_image": round(there_us, 1),
        "server_cpu_measured_over_projected": round(there_us / server_us, 2),
    }


def replayed(rows: list[dict[str, Any]], tree: Path) -> list[dict[str, Any]]:
    """The rows with serving processes given the engine's CPU per image where front-ends outrun it, measured here
    in `tree`'s code (once per model and route) and put in each row's own microseconds (its machine's PIL rate
    against this one's); and the device's rate as the engine's batching attains it: the img/s this checkout's
    engine serves, replayed, over the stand-in's device, whose waits are the H200 run's durations."""
    from bench.stand_in import engine_replayed, pil_one_core_rate

    here_pil = pil_one_core_rate()
    figures: dict[tuple[str, str], tuple[float, float | None]] = {}
    out = []
    for row in rows:
        if row["server"] != "vit-serve" or row["workers"] == 1:
            out.append(row)
            continue
        key = (row["model"], row["route"])
        if key not in figures:
            engine = engine_replayed(row["model"], row["route"], tree).engine_us_per_image
            figures[key] = (engine, engine_replayed(row["model"], row["route"]).device_img_s)
        engine, device = figures[key]
        us = engine * here_pil / row["pil_one_core_here_img_s"]
        added = {"engine_replayed_cpu_us_per_image": round(us, 1)}
        if device is not None:
            added["device_replayed_img_s"] = round(device, 1)
        out.append({**row, **added})
    return out


def markdown(entries: list[dict[str, Any]], gpu: dict[str, Any], args: argparse.Namespace) -> str:
    pil = gpu["decode"]["cpu_img_per_s"]["1"]
    lines = [
        "# The stand-in against a GPU host's run",
        "",
        f"`python -m bench.stand_in_calibration {args.rows} --gpu {args.gpu}"
        + (f" --replay-tree {args.replay_tree}" if args.replay_tree else "")
        + "`: rows of `bench.stand_in` "
        f"projected again with the GPU run's device and host ({host_cores(gpu)} cores, PIL on one core {pil:.0f} "
        f"img/s; nvJPEG with the resize {decode_rate(gpu):,.0f} img/s), beside what that host served "
        "(the best of its concurrencies). The mean batch is the stand-in's here, and the GPU host's. An engine figure "
        "marked *replayed* is its CPU where front-ends outrun it (`--replay-tree`), which sets its ceiling; the others "
        "are what it spent in the stand-in's row. With `--replay-tree` the device's img/s is at most what this "
        "checkout's engine served, replayed, over the stand-in's device (the device as the engine's batching attains "
        "it). *Server CPU per image*: the serving processes' (engine, front-ends, "
        "supervisor) in µs of the GPU host's cores, the stand-in's against what that host's spent (its server cores "
        "over the img/s it served).",
        "",
        *table(
            [
                "model",
                "route",
                "front-ends",
                "commit",
                "core scale",
                "engine µs/img, host core",
                "device img/s",
                "engine ceiling",
                "front-end ceiling",
                "projected",
                "bound by",
                "measured",
                "measured / projected",
                "mean batch here",
                "mean batch there",
                "server cores there",
                "server CPU µs/img, stand-in",
                "server CPU µs/img there",
                "there / stand-in",
            ],
            [
                [
                    e["model"],
                    e["route"],
                    e["workers"],
                    e["commit"],
                    f"{e['core_scale']:.2f}",
                    f"{e['engine_host_us_per_image']:.0f}" + (" (replayed)" if e["engine_replayed"] else ""),
                    f"{e['device_img_s']:,.0f}",
                    f"{e['engine_ceiling_img_s']:,.0f}",
                    f"{e['frontend_ceiling_img_s']:,.0f}",
                    f"{e['projected_img_s']:,.0f}",
                    e["bound_by"],
                    f"{e['measured_img_s']:,.0f}",
                    f"{e['measured_over_projected']:.2f}",
                    e["mean_batch_here"],
                    e["measured_mean_batch"],
                    e["measured_server_cores"],
                    f"{e['server_host_us_per_image']:,.0f}",
                    f"{e['measured_server_us_per_image']:,.0f}",
                    f"{e['server_cpu_measured_over_projected']:.2f}",
                ]
                for e in entries
            ],
            "lllrrrrrrrlrrrrrrrr",
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    gpu = json.loads(args.gpu.read_text())
    rows = json.loads(args.rows.read_text())
    if args.replay_tree is not None:
        rows = replayed(rows, args.replay_tree)
    entries = [e for row in rows if (e := calibrated(row, gpu)) is not None]
    entries.sort(key=lambda e: (e["model"], e["route"], e["workers"]))
    (args.out / f"{args.name}.json").write_text(json.dumps(entries, indent=1) + "\n")
    text = markdown(entries, gpu, args)
    (args.out / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
