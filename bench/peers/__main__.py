"""The field side by side: the service and every peer server on the same work, in alternated rounds.

    python -m bench.peers.venvs                          # the peers' environments, once
    python -m bench peers --name peers-cpu               # every peer, both models, both images
    python -m bench peers --peers mosec --models bundled --images png-small --concurrency 1 8 --rounds 1

Each server serves the same checkpoint (`model.checkpoint`), decodes with the service's decoder and preprocesses
with the checkpoint's evaluation transform, batches up to the same largest batch with the same wait where it
batches at all, and runs its forward on the same number of torch threads. Each is asked in the format its docs
recommend. Before it is loaded, each server's answer to each image is checked against the service's: every
probability within 1e-5. Then `hey` loads it at each concurrency, servers taken in turns, the order reversed every
other round, and the run records per server and level: req/s, p50 and p99, errors, the mean batch (from the
service's /metrics; from the batches a peer's own process ran, for the peers), and the CPU per request of all the
server's processes, read from /proc.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx

from app.settings import BUNDLED_WEIGHTS
from bench.common import RESULTS, sample_images, sample_label, write_results
from bench.peers import venvs
from bench.peers.plot import draw
from bench.peers.servers import Settings, Started, answer, lanes, scratch, start_peer, start_service
from bench.peers.summary import summary
from bench.peers.work import batch_counts
from bench.rounds import loaded
from harness import records
from harness.load import require_hey
from harness.models import vit_s16_checkpoint
from harness.records import table

TOLERANCE = 1e-5
REFERENCE = "service /predict, torch"  # the answers every other lane's are checked against
KINDS = {"png": "image/png", "jpeg": "image/jpeg"}
MODELS = {"bundled": "the bundled checkpoint (64 px, 10 classes)", "vit-s16": "ViT-S/16 (224 px, 1,000 classes)"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", nargs="+", choices=list(venvs.PEERS), default=list(venvs.PEERS))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--images", nargs="+", choices=["png-small", "jpeg-medium"], default=["png-small", "jpeg-medium"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128], help="the bundled model's levels")
    p.add_argument(
        "--forward-bound-concurrency",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        help="ViT-S/16's levels: at 6 req/s on one thread a request at 128 would wait past hey's 20 s timeout",
    )
    p.add_argument("--duration", type=float, default=4.0, help="seconds per level")
    p.add_argument(
        "--forward-bound-duration",
        type=float,
        default=18.0,
        help="ViT-S/16's seconds per level: at 6 req/s, enough answers for a p99 (hey gives none under 100)",
    )
    p.add_argument(
        "--forward-bound-images",
        nargs="+",
        choices=["png-small", "jpeg-medium"],
        default=["jpeg-medium"],
        help="ViT-S/16's images: its forward is 50 to 100 times an image's decoding, so one kind tells",
    )
    p.add_argument("--warm", type=float, default=1.0, help="seconds of the same load before each measurement")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the bundled model")
    p.add_argument("--forward-bound-rounds", type=int, default=1, help="rounds of ViT-S/16 (a quarter hour each)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads in every server")
    p.add_argument("--install", action="store_true", help="make the peers' environments first, where missing")
    p.add_argument("--name", default="peers-cpu", help="results file name (bench/results/NAME.json and .md)")
    p.add_argument("--out", type=Path, help="write the results here instead of bench/results/")
    p.add_argument("--render", type=Path, help="only write the tables and the plot again from this results file")
    return p.parse_args()


def start(server: str, settings: Settings, folder: Path) -> Started:
    if server.startswith("service"):
        return start_service(settings, "torch" if server == "service-torch" else "onnxruntime")
    return start_peer(server, settings, folder / server)


def served_name(started: Started) -> str:
    models = httpx.get(started.process.url + "/v1/models", timeout=10).json()["models"]
    name: str = models[0]["name"]
    return name


def preferred_batch(started: Started) -> int | None:
    """The batch the service fills to (VIT_PREFERRED_BATCH_SIZE: auto times it at warm-up), from its /metrics."""
    text = httpx.get(started.process.url + "/metrics", timeout=10).text
    m = re.search(r"^vit_preferred_batch_size\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return int(float(m.group(1))) if m else None


def run_model(
    model: str, weights: Path, args: argparse.Namespace, images: dict[str, bytes], folder: Path
) -> dict[str, Any]:
    """Every server on one model: the answers checked, then each lane loaded at each level, round after round."""
    settings = Settings(weights, args.max_batch_size, args.wait_ms, args.threads)
    servers = ["service", "service-torch", *args.peers]
    bound = model == "vit-s16"
    seconds = args.forward_bound_duration if bound else args.duration
    levels = args.forward_bound_concurrency if bound else args.concurrency
    images = {
        name: data for name, data in images.items() if name in (args.forward_bound_images if bound else args.images)
    }
    runs: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = {}
    answers: dict[str, dict[str, list[float]]] = {}
    configs: dict[str, dict[str, Any]] = {}
    for repeat in range(args.forward_bound_rounds if model == "vit-s16" else args.rounds):
        for server in servers if repeat % 2 == 0 else servers[::-1]:
            print(f"{model}, round {repeat + 1}: {server}", flush=True)
            started = start(server, settings, folder)
            try:
                started.process.wait_ready(300)
                service_model = served_name(started) if server.startswith("service") else ""
                chosen = [lane for lane in lanes(service_model or "vit").values() if lane.server == server]
                configs[server] = started.config
                if server.startswith("service"):  # each start times its batch sizes again: every round's choice
                    fitted = configs[server].setdefault("preferred_batch_size", [])
                    fitted.append(preferred_batch(started))
                for lane in chosen:
                    for image, data in images.items():
                        kind = KINDS[image.split("-")[0]]
                        asked = lane.check(data, kind)
                        answers.setdefault(lane.name, {})[image] = lane.read(answer(started.process, asked))
                        posted = lane.ask(data, kind)
                        body = folder / f"{re.sub(r'[^a-z0-9]+', '-', lane.name)}-{image}.body"
                        body.write_bytes(posted.body)
                        stats = started.stats
                        for c in levels:
                            result = loaded(
                                started.process,
                                posted.path,
                                body,
                                posted.content_type,
                                c,
                                seconds,
                                warm=args.warm,
                                headers=posted.headers,
                                batches=(lambda s=stats: batch_counts(s)) if stats else None,
                            )
                            result["round"] = repeat + 1
                            runs.setdefault(lane.name, {}).setdefault(image, {}).setdefault(c, []).append(result)
                            print(
                                f"  {lane.name} {image} c={c}: {result['requests_per_s']:.1f} req/s, "
                                f"p99 {result['p99_ms']:.0f} ms, {result['errors']} errors",
                                flush=True,
                            )
            finally:
                started.process.stop()
    reference = answers[REFERENCE]
    checks = {
        lane: {
            image: max(abs(a - b) for a, b in zip(probs, reference[image], strict=True)) for image, probs in by.items()
        }
        for lane, by in answers.items()
    }
    return {
        "model": MODELS[model],
        "concurrency": levels,
        "images": list(images),
        "seconds": seconds,
        "rounds": args.forward_bound_rounds if bound else args.rounds,
        "configs": configs,
        "checks": checks,
        "runs": runs,
    }


def shown(value: float, form: str) -> str:
    """A figure, or "-" where there is none (hey gives no p99 for fewer than 100 answers)."""
    return "-" if math.isnan(value) else f"{value:{form}}"


SERVICE_LANES = ("service /predict", "service V2", "service /predict, torch")


def ratios(model: dict[str, Any], image: str, levels: list[int]) -> list[str]:
    """Each peer's row: the service's req/s over the peer's at each level, and its p99 over the peer's, for each of
    the service's lanes."""
    runs = model["runs"]
    served = {lane: {c: summary(runs[lane][image][c]) for c in levels} for lane in SERVICE_LANES if lane in runs}
    rows = []
    for peer, by_image in runs.items():
        if peer in SERVICE_LANES or image not in by_image:
            continue
        them = {c: summary(by_image[image][c]) for c in levels}
        cells = []
        for c in levels:
            cells.append(
                ", ".join(
                    f"{s[c]['requests_per_s'] / them[c]['requests_per_s']:.2f}x "
                    f"({shown(s[c]['p99_ms'] / them[c]['p99_ms'], '.2f')})"
                    for s in served.values()
                )
            )
        rows.append([peer, *cells])
    header = ["peer", *(f"c={c}" for c in levels)]
    return [
        f"The service's req/s over each peer's (its p99 over the peer's), for {', '.join(served)} in that order:",
        "",
        *table(header, rows),
    ]


def markdown(report: dict[str, Any]) -> str:
    out = [
        "# The service and its peers, side by side",
        "",
        f"`{report['command']}` on {report['machine']}; each figure the mean of the rounds (alternated), each "
        "round's figures in the JSON. Every server: one torch thread "
        f"for the forward, batches of up to {report['max_batch_size']} with a {report['wait_ms']:g} ms wait where "
        "it batches, the service's decoder and preprocessing.",
        "",
    ]
    every_lane = lanes("model")
    for model in report["models"].values():
        for image in model["images"]:
            out += [
                f"## {model['model']}, {sample_label(image)}",
                "",
                f"{model['rounds']} round(s), {model['seconds']:g} s per level after {report['warm']:g} s of the same load.",
                "",
            ]
            levels = model["concurrency"]
            at_cpu = 32 if 32 in levels else min(levels)
            header = [
                "server",
                *(f"c={c} req/s (p99 ms)" for c in levels),
                "errors",
                f"mean batch at c={max(levels)}",
                f"CPU µs per request at c={at_cpu}",
            ]
            rows = []
            for lane, by_image in model["runs"].items():
                s = {c: summary(by_image[image][c]) for c in levels if c in by_image.get(image, {})}
                if not s:
                    continue
                top = s.get(max(levels))
                mid = s.get(at_cpu) or s[min(s)]
                rows.append(
                    [
                        lane,
                        *(
                            f"{s[c]['requests_per_s']:.1f} ({shown(s[c]['p99_ms'], '.0f')})" if c in s else "-"
                            for c in levels
                        ),
                        sum(v["errors"] for v in s.values()),
                        f"{top['mean_batch']:.1f}" if top and top["mean_batch"] else "-",
                        f"{mid['cpu_us']:.0f}",
                    ]
                )
            out += [*table(header, rows), ""]
            out += [*ratios(model, image, levels), ""]
    out += ["## What each server ran", ""]
    rows = []
    for name, lane in every_lane.items():
        configs = [m["configs"].get(lane.server) for m in report["models"].values()]
        config = next((c for c in configs if c), None)
        if config is None:
            continue
        checks = [m["checks"].get(name, {}) for m in report["models"].values()]
        worst = max((d for c in checks for d in c.values()), default=float("nan"))
        batching = lane.batching
        fitted = {
            MODELS[model].split(" (")[0]: sorted({n for n in c.get("preferred_batch_size", []) if n is not None})
            for model, m in report["models"].items()
            if (c := m["configs"].get(lane.server))
        }
        fitted = {model: n for model, n in fitted.items() if n}
        if fitted:
            sizes = "; ".join(f"{model} {' or '.join(map(str, n))}" for model, n in fitted.items())
            batching += (
                f", filled to the batch timed at warm-up to serve the most (VIT_PREFERRED_BATCH_SIZE=auto): {sizes}"
            )
        rows.append([name, config.get("version", "this checkout"), lane.protocol, batching, f"{worst:.1e}"])
    out += [
        *table(
            ["server", "version", "request", "batching", "largest difference from the service's probabilities"], rows
        ),
        "",
    ]
    return "\n".join(out)


def render(results: Path) -> None:
    """The tables (.md) and plot (.png) beside a results file, made again from its figures."""
    report = json.loads(results.read_text())
    for model in report["models"].values():  # JSON keeps the levels as text
        model["runs"] = {
            lane: {image: {int(c): rs for c, rs in by_level.items()} for image, by_level in by_image.items()}
            for lane, by_image in model["runs"].items()
        }
    results.with_suffix(".md").write_text(
        markdown(report).rstrip("\n") + f"\n\n{records.measured_line(report['record'])}\n"
    )
    draw(report, results.with_suffix(".png"))


def main() -> None:
    args = parse_args()
    if args.render:
        render(args.render)
        return
    require_hey()
    for peer in args.peers:
        if args.install:
            venvs.install(venvs.PEERS[peer])
        elif not venvs.installed(venvs.PEERS[peer]):
            sys.exit(
                f"python -m bench peers: {peer} is not installed; python -m bench.peers.venvs {peer} (or --install)"
            )
    samples = sample_images()
    images = {name: samples[name] for name in dict.fromkeys([*args.images, *args.forward_bound_images])}
    folder = scratch()
    report: dict[str, Any] = {
        "command": records.command_line().replace("python -m bench.peers", "python -m bench peers"),
        "machine": f"{records.cpu_model()}, {os.cpu_count()} cores",
        "warm": args.warm,
        "concurrency": args.concurrency,
        "images": list(images),
        "max_batch_size": args.max_batch_size,
        "wait_ms": args.wait_ms,
        "threads": args.threads,
        "models": {},
    }
    try:
        for model in args.models:
            weights = BUNDLED_WEIGHTS if model == "bundled" else vit_s16_checkpoint(folder / "vit-s16.safetensors")
            report["models"][model] = run_model(model, weights, args, images, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = markdown(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        records.write_results(args.out, args.name, report, text)
    else:
        write_results(args.name, report, text)
    draw(report, (args.out or RESULTS) / f"{args.name}.png")
    print(text)
    wrong = [
        f"{model}: {lane} {image} differs by {d:.1e}"
        for model, m in report["models"].items()
        for lane, by in m["checks"].items()
        for image, d in by.items()
        if d > TOLERANCE
    ]
    if wrong:
        sys.exit("answers differ from the service's:\n" + "\n".join(wrong))


if __name__ == "__main__":
    main()
