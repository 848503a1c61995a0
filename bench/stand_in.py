"""The GPU path's CPU side, measured without a GPU: the service over the device stand-in (`harness.stand_in`),
the CPU time of every process per image, and what that could feed on the H100 host.

    python -m bench.stand_in --model vit-b16 --route v2 --workers 1 2 4 --seconds 15
    python -m bench.stand_in --model vit-b16 --route predict --workers 1 4 --json /tmp/predict.json
    python -m bench.stand_in --route v2 --workers 2 --seconds 8 --trees . /tmp/before --repeats 3
    python -m bench.stand_in --shares 0 0.25 0.5 0.75 1 auto --model vit-b16   # see bench/stand_in_shares.py

With `--trees`, each checkout's service (`git worktree add /tmp/before REV`) is measured in turn, the trees
alternating `--repeats` times (`bench.rounds`), and a table gives each tree's CPU µs per image by role and img/s,
median and best: an A/B of two trees under the same load, what each spends here, with no projection. With
`--json`, the runs go there under their record.

For each VIT_WORKERS value: `python -m app` with the stand-in in place of the GPU (the H200's decode and
forward times as waits that use no CPU), loaded with `hey` at a concurrency that keeps this machine's cores
busy: `/predict` with one 500x375 JPEG a request, or V2 binary with 8 a request. It records the served
img/s, and the CPU time per image of each process role (the engine, the front-ends together, the
supervisor) and of the load generator.

The projection is what the CPU side could feed on a 16-core GPU host (the H100's, as the H200's): the smallest of
- the device's rate (the stand-in's batch times at the largest batch): with the CUDA decoder, a batch's
  decoding and another's forward one after the other, as they share the SMs; with the JPEG engines, decoding
  beside the forward at the engines' rate;
- the engine's ceiling: one core (a Python process, its GIL) over the engine's CPU per image. With `--replay`,
  that CPU is the engine's where front-ends outrun it (`bench.compare.engine_cost --replay`, the route's
  images, as many requests in flight as the GPU sweep's largest load: 256 for /predict, 128 for V2): at its
  ceiling the engine is that busy, and its loop's work per go is shared by the many calls each go reads.
  Without, it is what the engine spent here, where two cores leave it mostly idle;
- the front-ends' ceiling: one core each, on the cores left once the engine and the load generator have
  theirs, over the front-ends' CPU per image (one process: the same process as the engine, so its ceiling).
CPU times are scaled to the H100 host's cores by one measured ratio: that host's one-core PIL rate for the
same JPEG (211 img/s, bench/results/gpu-h100.md) against this machine's, measured in the same run.
It is a projection of the CPU side with the device's work replaced by measured durations, not a GPU
measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS
from bench.gpu.serving import bodies, random_checkpoint
from bench.rounds import alternated, loaded
from harness import records
from harness.images import photo_jpeg
from harness.models import VIT_S16_PREPROCESSING
from harness.records import commit, cpu_model, table
from harness.server import ROOT, ServerProcess, free_port
from harness.stand_in import (
    HARDWARE_DECODE_IMAGES_PER_S,
    NVJPEG_IMAGES_PER_S,
    RAW_IMAGES_PER_S,
    DeviceTimes,
)

H100_HOST_CORES = 16
H100_PIL_ONE_CORE = 211.0  # img/s, the same 500x375 JPEG decoded and preprocessed (bench/results/gpu-h100.md)
ROUTES = {"predict": ("/predict", 1, 64), "v2": ("/v2/models/{model}/infer", 8, 16)}  # path, images, concurrency
# requests in flight where the engine is replayed (--replay): the largest load of the GPU sweep (bench/gpu/serving.py),
# where the service served its best
REPLAY_CONCURRENCY = {"predict": 256, "v2": 128}
MAX_BATCH_SIZE = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.stand_in", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["vit-s16", "vit-b16"], default="vit-b16")
    p.add_argument("--route", choices=list(ROUTES), default="v2")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="VIT_WORKERS values to run")
    p.add_argument("--seconds", type=float, default=15.0, help="load per configuration (after 3 s of warm-up)")
    p.add_argument("--concurrency", type=int, help="hey's workers (default: 64 for predict, 16 for v2)")
    p.add_argument("--json", type=Path, help="where the results go (default bench/results/stand-in-cpu.json, .md)")
    p.add_argument(
        "--project-only",
        action="store_true",
        help="measure nothing: project the results already in --json again with the current device model",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="also measure the engine where front-ends outrun it (bench.compare.engine_cost --replay: the route's "
        "images, 256 /predict or 128 V2 requests in flight, the GPU sweep's largest load) and take the engine's "
        "ceiling from that",
    )
    p.add_argument(
        "--cpu-decode-share",
        type=float,
        default=0.0,
        help="VIT_CPU_DECODE_SHARE: the share of plain JPEGs the front-ends decode with PIL; the device decodes the "
        "rest (not with --replay, whose engine takes every JPEG encoded)",
    )
    p.add_argument(
        "--shares",
        nargs="+",
        help="VIT_CPU_DECODE_SHARE values, numbers and auto, measured against each other over V2 on a stand-in "
        "--slower times as long as the H200 (bench/stand_in_shares.py); the other options but --model, --seconds, "
        "--repeats and --json are not used",
    )
    p.add_argument(
        "--slower",
        type=float,
        help="with --shares: how much slower than the H200 the stand-in runs (default: as this machine's cores to a "
        "16-core GPU host's, by PIL's one-core rate)",
    )
    p.add_argument(
        "--settle", type=float, default=20.0, help="with --shares: seconds auto settles before it is measured"
    )
    p.add_argument("--trees", type=Path, nargs="+", help="checkouts to compare, each serving its own code")
    p.add_argument("--repeats", type=int, default=1, help="runs of each tree, alternating (with --trees)")
    args = p.parse_args()
    if args.trees and (args.project_only or args.replay):
        p.error("--trees compares the services as measured: without --project-only and --replay")
    return args


def pil_one_core_rate(images: int = 512) -> float:
    """img/s of PIL decoding and preprocessing 500x375 JPEGs on one thread, measured as the H100 host's 211
    img/s was (`bench/gpu/decoding.py`): `images` distinct photos through a pool of one thread, torch's
    default thread count, wall clock."""
    from app.core.images.decode import decode_image
    from app.core.images.prepare import Preprocessor

    files = [photo_jpeg(i) for i in range(images)]
    pre = Preprocessor(VIT_S16_PREPROCESSING)

    def on_cpu(data: bytes) -> torch.Tensor:
        return pre(decode_image(data, "x.jpg", 3, 10**8))

    with ThreadPoolExecutor(1) as pool:
        list(pool.map(on_cpu, files[:32]))
        started = time.perf_counter()
        list(pool.map(on_cpu, files))
        return images / (time.perf_counter() - started)


@dataclass(frozen=True)
class Load:
    """What hey sends, and how many at once."""

    body: Path
    content_type: str
    headers: dict[str, str]
    concurrency: int


def project(
    model: str,
    workers: int,
    per_image_us: dict[str, float],
    scale: float,
    device_img_s: tuple[float, float] | None = None,
    host_cores: int = H100_HOST_CORES,
    device_replayed: float | None = None,
    cpu_share: float = 0.0,
) -> dict[str, float]:
    """img/s the CPU side could feed on the H100 host: the smallest of the device, the engine and the
    front-ends (each in H100-host microseconds: this machine's times `scale`), with each of the two decoders
    (`DeviceTimes.images_per_s`): the CUDA decoder, which shares the SMs with the forward, and the hardware
    JPEG engines at their own rate. Another GPU host: its device's two rates and its cores given
    (`scale` then to its cores). `device_replayed`: the img/s the replayed engine served over the stand-in's
    device (`Replayed`), which caps the CUDA decoder's: the device as the engine's batching attains it. `cpu_share`:
    the JPEGs the front-ends decoded (VIT_CPU_DECODE_SHARE), which the device does not."""
    host = {role: us * scale for role, us in per_image_us.items()}
    times = DeviceTimes(model, MAX_BATCH_SIZE)
    device, hardware = device_img_s or (
        times.images_per_s("cuda", cpu_share),
        times.images_per_s("hardware", cpu_share),
    )
    if device_replayed is not None:
        device = min(device, device_replayed)
    engine = 1e6 / host["engine"] if host["engine"] else float("inf")
    generator = host["load generator"] / 1e6  # cores per img/s
    cores = host_cores - 1 - (host["supervisor"] / 1e6) * device  # the engine's core, the supervisor's share
    if workers == 1:
        front = engine  # the one process is the front too
    else:
        per_core = 1e6 / host["front-ends"]
        # each front-end is one core at most; the load generator takes its share of what is left
        front = min(workers * per_core, cores * per_core / (1 + per_core * generator))
    return {
        "device_img_s": device,
        "device_hardware_img_s": hardware,
        "engine_ceiling_img_s": engine,
        "frontend_ceiling_img_s": front,
        "projected_img_s": min(device, engine, front),
        "projected_hardware_img_s": min(hardware, engine, front),
    }


def projected_again(entry: dict[str, Any], machine: str) -> dict[str, Any]:
    """An entry projected with the current device model; its CPU ceilings (from the unrounded measurement)
    and the machine it was measured on kept."""
    share = entry.get("cpu_decode_share", 0.0)
    device = {d: DeviceTimes(entry["model"], MAX_BATCH_SIZE).images_per_s(d, share) for d in ("cuda", "hardware")}
    device["cuda"] = min(device["cuda"], entry.get("device_replayed_img_s", device["cuda"]))
    cpu = min(entry["engine_ceiling_img_s"], entry["frontend_ceiling_img_s"])
    return {
        **entry,
        "machine": entry.get("machine", machine),
        "device_img_s": round(device["cuda"], 1),
        "device_hardware_img_s": round(device["hardware"], 1),
        "raw_img_s": RAW_IMAGES_PER_S[entry["model"]],
        "projected_img_s": round(min(device["cuda"], cpu), 1),
        "projected_hardware_img_s": round(min(device["hardware"], cpu), 1),
    }


def main() -> None:
    args = parse_args()
    if args.shares:
        from bench import stand_in_shares

        stand_in_shares.run(args)
        return
    if args.project_only:
        target = args.json or RESULTS / "stand-in-cpu.json"
        # entries from before the machine was recorded: the one their page names
        named = re.search(r"^Here: (.+?), \d+ cores;", target.with_suffix(".md").read_text(), re.MULTILINE)
        machine = named.group(1) if named else cpu_model()
        report([projected_again(e, machine) for e in stored_rows(target)], args)
        return
    if args.replay and args.cpu_decode_share:
        raise SystemExit("--replay replays an engine that takes every JPEG encoded: leave out --cpu-decode-share")
    _, _, default_concurrency = ROUTES[args.route]
    concurrency = args.concurrency or default_concurrency
    here_pil = None  # --trees compares what each tree spends here, and projects nothing
    if not args.trees:
        here_pil = pil_one_core_rate()
        print(f"PIL on one core: {here_pil:.0f} img/s here, {H100_PIL_ONE_CORE:.0f} on the H100 host")
    replayed = engine_replayed(args.model, args.route) if args.replay else None
    entries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        checkpoint = random_checkpoint(folder, args.model)
        form_type, v2_headers = bodies(folder, 8)
        if args.route == "predict":
            load = Load(folder / "form", form_type, {}, concurrency)
        else:
            load = Load(folder / "v2", "application/octet-stream", v2_headers, concurrency)
        for workers in args.workers:
            if args.trees:
                runs = alternated(
                    [t.resolve() for t in args.trees],
                    args.repeats,
                    lambda tree: service_entry(args, checkpoint, load, workers, here_pil, tree=tree),  # noqa: B023
                )
                entries += [e for tree_runs in runs.values() for e in tree_runs]
                continue
            entries.append(service_entry(args, checkpoint, load, workers, here_pil, replayed))
    if args.trees:
        compared(entries, args)
    else:
        report(entries, args)


def compared(entries: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The trees' runs side by side: CPU µs per image by role (best: the least) and img/s (best: the most),
    median (best), per VIT_WORKERS value; the runs and the table to `--json` (and its .md) when given."""

    def figure(runs: list[dict[str, Any]], field: str, best: Callable[[list[float]], float]) -> str:
        values = [float(e[field]) for e in runs]
        return f"{statistics.median(values):.1f} ({best(values):.1f})"

    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in entries:
        groups.setdefault((e["workers"], e["tree"]), []).append(e)
    header = ["workers", "tree", "commit", "runs", "engine µs/img", "front-ends µs/img", "served img/s"]
    rows = [
        (
            workers,
            tree,
            runs[0]["commit"],
            len(runs),
            figure(runs, "engine_cpu_us_per_image", min),
            figure(runs, "frontend_cpu_us_per_image", min),
            figure(runs, "served_img_s", max),
        )
        for (workers, tree), runs in groups.items()
    ]
    text = "\n".join(
        [
            f"# The service over the device stand-in, trees compared: {args.model}, {args.route}",
            "",
            f"Each tree served in turn, alternating, {args.repeats} run(s) of {args.seconds:g} s each: median (best).",
            "",
            *table(header, rows, "rllrrrr"),
            "",
        ]
    )
    if args.json:  # the record (commit, machine, command), then the runs; the table beside them
        args.json.parent.mkdir(parents=True, exist_ok=True)
        records.write_results(args.json.parent, args.json.stem, {"runs": entries}, text)
    else:
        print(text)


@dataclass(frozen=True)
class Replayed:
    """The engine where front-ends outrun it (`bench.compare.engine_cost --replay`): its CPU µs per image here, and
    the img/s it served. With more requests in flight than two batches hold, that rate is the stand-in's device as
    the engine's batching attains it: two batches in flight, each formed within VIT_MAX_WAIT_MS, a decode waiting for
    the forward before it."""

    engine_us_per_image: float
    img_s: float

    @property
    def device_img_s(self) -> float | None:
        """The rate as the device's, unless the engine was busy most of the time here (over 0.8 of a core): then this
        machine bound it, not the device."""
        busy = self.engine_us_per_image * self.img_s / 1e6
        return self.img_s if busy <= 0.8 else None


def engine_replayed(model: str, route: str, tree: Path | None = None) -> Replayed:
    """The engine here where front-ends outrun it: `bench.compare.engine_cost --replay` with `route`'s images a
    request and as many requests in flight as the GPU sweep's largest load, in `tree`'s code (this checkout's by
    default, whose stand-in waits for the device's durations)."""
    from bench.compare import engine_cost

    _, images, _ = ROUTES[route]
    replay = argparse.Namespace(
        model=model,
        images=images,
        front_ends=4,
        concurrency=REPLAY_CONCURRENCY[route],
        seconds=8.0,
        replay=True,
    )
    run = engine_cost.worker((tree or Path(__file__).parent.parent).resolve(), replay)
    print(f"{tree or 'here'}, {model} {route}: the engine where front-ends outrun it: {json.dumps(run)}", flush=True)
    return Replayed(float(run["engine_us_per_image"]), float(run["img_s"]))


def service_entry(
    args: argparse.Namespace,
    checkpoint: Path,
    load: Load,
    workers: int,
    here_pil: float | None,
    replayed: Replayed | None = None,
    tree: Path = ROOT,
) -> dict[str, Any]:
    """The service with VIT_WORKERS=`workers` over the stand-in, in `tree`'s code (this checkout's by default):
    measured here and, given `here_pil` (not with `--trees`), projected on the H100 host."""
    path, _, _ = ROUTES[args.route]
    port = free_port()
    env = {
        "STAND_IN_MODEL": args.model,
        "VIT_WEIGHTS": str(checkpoint),
        "VIT_DEVICE": "cpu",
        "VIT_BACKEND": "torch",
        "VIT_WORKERS": str(workers),
        "VIT_MAX_BATCH_SIZE": str(MAX_BATCH_SIZE),
        "VIT_MAX_WAIT_MS": "5",
        "VIT_MAX_QUEUE": "8192",
        "VIT_MAX_FILES": "64",
        "VIT_LOG_LEVEL": "warning",
        "VIT_GRPC_PORT": "0",
        "VIT_CPU_DECODE_SHARE": str(args.cpu_decode_share),
    }
    if tree != ROOT:
        env["PYTHONPATH"] = str(tree)
    argv = [sys.executable, "-m", "harness.stand_in_app", "--host", "127.0.0.1", "--port", str(port)]
    with ServerProcess(argv, env, port, cwd=tree) as server:
        route = path.format(model=checkpoint.stem)  # VIT_WEIGHTS serves the file under its stem
        m = loaded(
            server, route, load.body, load.content_type, load.concurrency, args.seconds, workers, 3, load.headers
        )
    entry = summary("vit-serve", args, workers, load, m, here_pil, replayed)
    if args.trees:
        entry |= {"tree": str(tree), "commit": commit(tree)}
    print(json.dumps(entry), flush=True)
    entry["settings"] = {k: v for k, v in env.items() if k.startswith("VIT_") and k != "VIT_WEIGHTS"}
    return entry


def summary(
    server: str,
    args: argparse.Namespace,
    workers: int,
    load: Load,
    m: dict[str, Any],
    here_pil: float | None,
    replayed: Replayed | None = None,
) -> dict[str, Any]:
    """One results entry: what was measured (`m`, as `bench.rounds.loaded` gives it), per image, and, given
    `here_pil`, the projection (when `replayed`, the engine's ceiling from its CPU per image where front-ends outrun
    it, and the CUDA decoder's device at most the rate it served)."""
    _, images, _ = ROUTES[args.route]
    per_request = {"engine": m["cpu_us"]["server"], "front-ends": 0.0, "supervisor": 0.0} | m["cpu_us"]  # one process
    per_image = {role: us / images for role, us in per_request.items()}
    if workers == 1:  # one process, the front-end too: the replay measures an engine process of its own
        replayed = None
    engine = per_image if replayed is None else {**per_image, "engine": replayed.engine_us_per_image}
    device_replayed = replayed.device_img_s if replayed is not None else None
    share = args.cpu_decode_share
    projected: dict[str, float] = {}
    if here_pil is not None:
        scale = here_pil / H100_PIL_ONE_CORE  # a microsecond here is `scale` microseconds on the H100 host's cores
        projection = project(args.model, workers, engine, scale, device_replayed=device_replayed, cpu_share=share)
        projected = {k: round(v, 1) for k, v in projection.items()}
        projected |= {"pil_one_core_here_img_s": round(here_pil, 1), "core_scale_to_h100_host": round(scale, 3)}
    extra: dict[str, float] = {}
    if replayed is not None:
        extra["engine_replayed_cpu_us_per_image"] = round(replayed.engine_us_per_image, 1)
    if device_replayed is not None:
        extra["device_replayed_img_s"] = round(device_replayed, 1)
    if share:
        extra["cpu_decode_share"] = share
    return {
        "server": server,
        "commit": commit(ROOT),
        "model": args.model,
        "route": args.route,
        "workers": workers,
        "concurrency": load.concurrency,
        "images_per_request": images,
        "served_img_s": round(m["requests_per_s"] * images, 1),
        "errors": m["errors"],
        "mean_batch": m["mean_batch"] and round(m["mean_batch"], 1),
        "engine_cpu_us_per_image": round(per_image["engine"], 1),
        "frontend_cpu_us_per_image": round(per_image["front-ends"], 1),
        "supervisor_cpu_us_per_image": round(per_image["supervisor"], 1),
        "load_generator_cpu_us_per_image": round(per_image["load generator"], 1),
        **extra,
        "cores_busy_here": {role: round(us * m["requests_per_s"] / 1e6, 2) for role, us in per_request.items()},
        **projected,
        "raw_img_s": RAW_IMAGES_PER_S[args.model],
        "machine": cpu_model(),
    }


def stored_rows(target: Path) -> list[dict[str, Any]]:
    """The rows a results file holds (each with the commit and machine it was measured on)."""
    if not target.exists():
        return []
    return list(json.loads(target.read_text())["rows"])


def report(entries: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """`entries` written over the rows of the same model, route and workers in the results file, under the record
    of this run; the other rows kept as they were measured."""
    target = args.json or RESULTS / "stand-in-cpu.json"
    previous = stored_rows(target)

    def key(e: dict[str, Any]) -> tuple[str, str, str, int]:
        return (e["model"], e["route"], e["server"], e["workers"])

    mine = {key(e) for e in entries}
    everything = sorted([e for e in previous if key(e) not in mine] + entries, key=key)
    target.parent.mkdir(parents=True, exist_ok=True)
    records.write_results(target.parent, target.stem, {"rows": everything}, markdown(everything))


def markdown(entries: list[dict[str, Any]]) -> str:
    rows = [
        (
            e["server"],
            e.get("commit", ""),
            e["model"],
            e["route"],
            e["workers"],
            f"{e['served_img_s']:.0f}",
            f"{e['engine_cpu_us_per_image']:.0f}",
            f"{e['frontend_cpu_us_per_image']:.0f}",
            f"{e['core_scale_to_h100_host']:.2f}",
            f"{e['engine_cpu_us_per_image'] * e['core_scale_to_h100_host']:.0f}",
            f"{e['frontend_cpu_us_per_image'] * e['core_scale_to_h100_host']:.0f}",
            f"{e['engine_replayed_cpu_us_per_image'] * e['core_scale_to_h100_host']:.0f}"
            if "engine_replayed_cpu_us_per_image" in e
            else "",
            f"{e['supervisor_cpu_us_per_image']:.0f}",
            f"{e['load_generator_cpu_us_per_image']:.0f}",
            f"{e['device_img_s']:.0f}",
            f"{e['device_hardware_img_s']:.0f}",
            f"{e['engine_ceiling_img_s']:.0f}",
            f"{e['frontend_ceiling_img_s']:.0f}",
            f"**{e['projected_img_s']:.0f}**",
            f"{e['projected_img_s'] / e['raw_img_s']:.2f}",
            f"{e['projected_hardware_img_s']:.0f}",
        )
        for e in entries
    ]
    header = [
        *("server", "commit", "model", "route", "workers", "served here img/s", "engine µs/img", "front-ends µs/img"),
        *("core scale", "engine µs/img, host core", "front-ends µs/img, host core"),
        "engine µs/img where front-ends outrun it, host core",
        *("supervisor µs/img", "hey µs/img", "device img/s, CUDA decoder", "device img/s, JPEG engines"),
        *("engine ceiling", "front-end ceiling", "projected img/s, CUDA decoder", "of raw"),
        "projected img/s, JPEG engines",
    ]
    lines = [
        "# The GPU path's CPU side on the device stand-in",
        "",
        "`python -m bench.stand_in` (see its docstring). Each row names the commit it was measured at; the last line, "
        "the run that wrote this file. CPU µs per image measured here, and in µs of a GPU-host core",
        "(times the run's core scale: the one-core PIL rate here over the H100 host's); ceilings and the",
        "projection on the H100 host's 16 cores, CPU times scaled by the one-core PIL rate of the same JPEG.",
        "A projection with the device's work replaced by the H200's measured durations (the run that served the "
        "service, 18e3d3d), not a GPU measurement.",
        "Where a row has the engine's CPU where front-ends outrun it (`--replay`: `bench.compare.engine_cost "
        "--replay`, the route's images, 256 /predict or 128 V2 requests in flight), the engine's ceiling is one "
        "core over that, and the CUDA decoder's device rate is at most the img/s that replayed engine served over the "
        "stand-in's device: the device as the engine's batching attains it.",
        "Two devices side by side. *CUDA decoder*: nvJPEG with the resize at its H200 rate "
        f"({NVJPEG_IMAGES_PER_S:,.0f} img/s), one batch's decoding after another's forward (they share the SMs). "
        "*JPEG engines*: the hardware decoder beside the SMs at "
        f"{HARDWARE_DECODE_IMAGES_PER_S:,.0f} img/s, the rate the H200's engines kept beside a CUDA-graphed "
        "forward that never pauses (nvImageCodec 0.9; the latest H200 run in bench/results/gpu-summary.json that "
        "measured it). Alone they decoded 20,000 to 27,000; the service, whose GPU pauses between batches, served "
        "4,368 img/s with them (bench/results/gpu-h200-jpeg-engines.md).",
        "",
        *table(header, rows, "llllr" + "r" * 16),
        "",
    ]
    pil = sorted({e["pil_one_core_here_img_s"] for e in entries})
    scales = sorted({e["core_scale_to_h100_host"] for e in entries})
    machines = ", ".join(sorted({e.get("machine", cpu_model()) for e in entries}))
    lines.append(
        f"Here: {machines}, {os.cpu_count()} cores; PIL on one core {pil[0]:.0f} to {pil[-1]:.0f} img/s in"
        f" the runs (H100 host: {H100_PIL_ONE_CORE:.0f}), so a µs here is {scales[0]:.2f} to {scales[-1]:.2f} µs there."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
