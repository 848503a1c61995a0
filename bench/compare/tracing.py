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
import tempfile
from pathlib import Path
from typing import Any

from app.settings import BUNDLED_WEIGHTS
from bench.common import multipart, sample_images, sample_label, write_results
from bench.rounds import alternated, loaded, rounds_table
from harness.otlp import Receiver
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


def main() -> None:
    args = parse_args()
    kind = args.image.split("-")[0]
    data, content_type = multipart(sample_images()[args.image], f"image.{kind}", f"image/{kind}")
    with tempfile.TemporaryDirectory() as tmp, Receiver(keep=False) as receiver:
        body = Path(tmp) / "request.body"
        body.write_bytes(data)
        on = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_TRACES_SAMPLER": "always_on",
        }
        sampled = {**on, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
        over_http = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint, "OTEL_TRACES_SAMPLER": "always_on"}
        servers = {"tracing off": {}, "tracing on": on, OVER_HTTP: over_http, SAMPLED: sampled}

        def run(label: str) -> dict[str, Any]:
            with Server(
                BUNDLED_WEIGHTS, None, tree=ROOT, VIT_GRPC_PORT="0", VIT_LOG_LEVEL="warning", **servers[label]
            ) as server:
                measured = loaded(server, "/predict", body, content_type, args.concurrency, args.seconds)
            print(label, measured, flush=True)
            return measured

        runs = alternated(args.configs, args.rounds, run)
        exports = receiver.count
    report = {
        "image": args.image,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "runs": runs,
        "exports_received": exports,
    }
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    return "\n".join(
        [
            "# Tracing cost on the CPU",
            "",
            f"`/predict` with one {sample_label(report['image'])} at concurrency {report['concurrency']}, "
            f"{report['seconds']:.0f} s per run, rounds alternating. Tracing on exports the spans over OTLP/gRPC "
            "(OTLP/HTTP where the row says so) to a local receiver that counts the exports without parsing them "
            f"({report['exports_received']:,} in all). The server's CPU time (user + system, from /proc) over the "
            "requests it answered is what a request costs it, a figure less shaken than the rate by what else the "
            "machine runs.",
            "",
            *rounds_table(report["runs"]),
            "",
        ]
    )


if __name__ == "__main__":
    main()
