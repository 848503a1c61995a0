"""What tracing costs the server: tracing off, on with every request exported, and on with one in 10 sampled.

    python -m bench.compare.tracing --rounds 3 --seconds 10

Every server is `python -m app` with the bundled model on the CPU, loaded with `hey` posting one image to
`/predict` (multipart) at concurrency 32: by default a 500x375 JPEG, a photo's size, which the server decodes and
resizes; `--image png-small` posts the bundled model's own 64 px PNG, the cheapest request and so the one tracing
costs most. Rounds alternate the servers: tracing off (no OTEL_ variables), tracing on (OTLP over gRPC to a local
receiver in the benchmark's process that counts the exports without parsing them, so that it takes next to no CPU
from the server), and one request in 10 traced (`parentbased_traceidratio`, 0.1). "tracing on, OTLP/HTTP" (not
run by default) exports over http/protobuf, the SDK's default protocol, to the same receiver. `--configs` picks
the servers and their order; the first is what the others are set beside.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from app.settings import BUNDLED_WEIGHTS
from bench.common import multipart, sample_images, sample_label, write_results
from harness.load import run_hey
from harness.otlp import Receiver
from harness.records import commit, table
from harness.server import ROOT, Server

SAMPLED = "tracing on, 10% sampled"
OVER_HTTP = "tracing on, OTLP/HTTP"  # the protocol's default, http/protobuf, where the others export over gRPC


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare.tracing", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--image", choices=sorted(sample_images()), default="jpeg-medium", help="the posted image")
    p.add_argument("--name", default="tracing-cpu")
    p.add_argument(
        "--configs",
        nargs="+",
        default=["tracing off", "tracing on", SAMPLED],
        choices=["tracing off", "tracing on", SAMPLED, OVER_HTTP],
        help="which servers, in each round's order",
    )
    return p.parse_args()


def start(env: dict[str, str]) -> Server:
    server = Server(BUNDLED_WEIGHTS, None, VIT_GRPC_PORT="0", VIT_LOG_LEVEL="warning", **env)
    server.wait_ready(180)
    return server


def main() -> None:
    args = parse_args()
    kind = args.image.split("-")[0]
    data, content_type = multipart(sample_images()[args.image], f"image.{kind}", f"image/{kind}")
    runs: dict[str, list[float]] = {label: [] for label in args.configs}
    cpu_us: dict[str, list[float]] = {label: [] for label in args.configs}
    exports = 0
    with tempfile.NamedTemporaryFile(suffix=".body") as f, Receiver(keep=False) as receiver:
        f.write(data)
        f.flush()
        body = Path(f.name)
        on = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_TRACES_SAMPLER": "always_on",
        }
        sampled = {**on, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
        over_http = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint, "OTEL_TRACES_SAMPLER": "always_on"}
        servers = {"tracing off": {}, "tracing on": on, OVER_HTTP: over_http, SAMPLED: sampled}
        for _ in range(args.rounds):
            for label in args.configs:
                server = start(servers[label])
                try:
                    run_hey(server.url + "/predict", body, content_type, args.concurrency, 2)  # warm
                    cpu = server.cpu_seconds()
                    r = run_hey(server.url + "/predict", body, content_type, args.concurrency, args.seconds)
                    cpu = server.cpu_seconds() - cpu
                finally:
                    server.stop()
                runs[label].append(r.requests_per_s)
                cpu_us[label].append(cpu / (r.ok + r.errors) * 1e6)
                print(
                    f"{label}: {r.requests_per_s:.1f} req/s, {cpu_us[label][-1]:.0f} µs CPU, {r.errors} errors",
                    flush=True,
                )
        exports = receiver.count
    report = {
        "cpu_count": os.cpu_count(),
        "this": commit(ROOT),
        "image": args.image,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "runs": runs,
        "server_cpu_us": cpu_us,
        "exports_received": exports,
    }
    write_results(args.name, report, markdown(report))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def markdown(report: dict[str, Any]) -> str:
    base_label = next(iter(report["runs"]))  # the first server of each round: what the others are set beside
    base = mean(report["runs"][base_label])
    base_cpu = mean(report["server_cpu_us"][base_label])
    rows = []
    for label, values in report["runs"].items():
        cpu = report["server_cpu_us"][label]
        rows.append(
            [
                label,
                ", ".join(f"{v:.1f}" for v in values),
                f"{mean(values):.1f}",
                f"{mean(values) / base:.3f}",
                ", ".join(f"{v:.0f}" for v in cpu),
                f"{mean(cpu) - base_cpu:+.0f} µs",
            ]
        )
    return "\n".join(
        [
            f"# Tracing cost on the CPU ({report['cpu_count']} cores)",
            "",
            f"`python -m bench.compare.tracing`: `/predict` with one {sample_label(report['image'])} at "
            f"concurrency {report['concurrency']}, "
            f"{report['seconds']:.0f} s per run, rounds alternating; this tree {report['this']}. Tracing on exports the spans over OTLP/gRPC (OTLP/HTTP where the row says so) to a local "
            f"receiver that counts the exports without parsing them ({report['exports_received']:,} in all). "
            "The server's CPU time (user + system, from /proc) over the requests it answered is what a request "
            "costs it, a figure less shaken than the rate by what else the 2 cores run.",
            "",
            *table(
                [
                    "server",
                    "req/s (each round)",
                    "mean",
                    f"of {base_label}",
                    "server CPU µs per request (each round)",
                    f"CPU per request beside {base_label}",
                ],
                rows,
            ),
            "",
        ]
    )


if __name__ == "__main__":
    main()
