"""One run of the serving benchmark; writes bench/results/<name>.json, .md and .png.

    python -m bench.run                       # bundled checkpoint, batch 32, wait 5 ms, 10 s per level
    python -m bench.run --duration 5 --concurrency 1 8 32 --no-litserve

Measured on the same machine, in this order: (1) the limit: raw forward throughput of the model on
pre-made tensors at each batch size, and the per-image preprocessing cost; (2) the service under
`hey`, posting raw image bytes, at each concurrency; (3) the service with batching off; (4) the
service and LitServe, posting the same multipart body, at each concurrency. Compare ratios within
one run: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import torch

from app.settings import BUNDLED_WEIGHTS
from bench.limits import forward_throughput, preprocessing_cost, sample_images
from bench.load import LoadResult, ServerProcess, require_hey, run_hey, start_litserve, start_service
from model.checkpoint import load_checkpoint
from model.device import resolve_device

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, default=BUNDLED_WEIGHTS)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per load level")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each server (0: default)")
    p.add_argument("--no-litserve", action="store_true", help="skip the LitServe peer")
    p.add_argument("--attention", action="store_true", help="also measure attention=rollout at concurrency 1")
    p.add_argument("--name", default="cpu", help="results file name")
    return p.parse_args()


def multipart(data: bytes, filename: str) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


def check_peer_threads(server: ServerProcess, body: Path, content_type: str, threads: int) -> int:
    """The torch threads LitServe's inference worker really runs with; they must be the service's."""
    r = httpx.post(
        server.url + "/predict", content=body.read_bytes(), headers={"content-type": content_type}, timeout=30
    )
    r.raise_for_status()
    worker: int = r.json()["worker_threads"]
    if threads and worker != threads:
        raise SystemExit(f"LitServe's worker runs {worker} torch threads, the service {threads}: not a fair peer")
    print(f"  LitServe worker: {worker} torch threads (checked)")
    return worker


def sweep(
    server: ServerProcess, path: str, body: Path, ctype: str, levels: list[int], seconds: float, label: str
) -> list[LoadResult]:
    results = []
    for c in levels:
        r = run_hey(server.url + path, body, ctype, c, seconds)
        print(f"  {label:<22} c={c:<4} {r.requests_per_s:8.1f} req/s  p50 {r.p50_ms:7.2f}  p99 {r.p99_ms:7.2f} ms  "
              f"errors {r.errors}  batch {r.mean_batch_size or float('nan'):.2f}", flush=True)  # fmt: skip
        results.append(r)
    return results


def main() -> None:
    args = parse_args()
    require_hey()
    RESULTS.mkdir(exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device("auto")
    ckpt = load_checkpoint(args.weights, device)
    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": torch.get_num_threads(), "device": str(device), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "settings": {"weights": str(args.weights), "model_version": ckpt.version, "max_batch_size": args.max_batch_size,
                     "wait_ms": args.wait_ms, "duration_s": args.duration, "threads": args.threads},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }  # fmt: skip
    print("1. limits: forward throughput on pre-made tensors, preprocessing per image")
    report["forward"] = [asdict(r) for r in forward_throughput(ckpt, device, args.max_batch_size)]
    for r in report["forward"]:
        print(f"  batch {r['batch_size']:>4}: {r['images_per_s']:9.1f} img/s ({r['ms_per_batch']:.2f} ms)")
    report["preprocess_ms"] = preprocessing_cost(ckpt)
    print("  preprocess ms/image:", {k: round(v, 3) for k, v in report["preprocess_ms"].items()})
    del ckpt

    image = sample_images()["png-small"]
    raw_body, form_body = RESULTS / "body.png", RESULTS / "body.multipart"
    raw_body.write_bytes(image)
    form, form_type = multipart(image, "shape.png")
    form_body.write_bytes(form)
    runs: dict[str, list[LoadResult]] = {}
    try:
        print("2. service, batching on (raw bytes)")
        server = start_service(args.weights, args.max_batch_size, args.wait_ms, args.threads)
        try:
            runs["service"] = sweep(
                server, "/predict", raw_body, "image/png", args.concurrency, args.duration, "service"
            )
            runs["service-multipart"] = sweep(
                server, "/predict", form_body, form_type, args.concurrency, args.duration, "service (multipart)"
            )
            if args.attention:
                runs["service-rollout"] = sweep(
                    server, "/predict?attention=rollout", raw_body, "image/png", [1], args.duration, "service + rollout"
                )
        finally:
            server.stop()
        print("3. service, batching off (VIT_MAX_BATCH_SIZE=1)")
        server = start_service(args.weights, 1, args.wait_ms, args.threads)
        try:
            runs["unbatched"] = sweep(
                server, "/predict", raw_body, "image/png", args.concurrency, args.duration, "unbatched"
            )
        finally:
            server.stop()
        if not args.no_litserve:
            print("4. LitServe, same checkpoint and batch settings (multipart)")
            server = start_litserve(args.weights, args.max_batch_size, args.wait_ms, args.threads)
            try:
                report["litserve_worker_threads"] = check_peer_threads(server, form_body, form_type, args.threads)
                runs["litserve"] = sweep(
                    server, "/predict", form_body, form_type, args.concurrency, args.duration, "litserve"
                )
            finally:
                server.stop()
    finally:
        raw_body.unlink(missing_ok=True)
        form_body.unlink(missing_ok=True)
    report["load"] = {k: [asdict(r) for r in v] for k, v in runs.items()}
    report["targets"] = targets(report)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    (RESULTS / f"{args.name}.md").write_text(markdown(report))
    plot(report, RESULTS / f"{args.name}.png")
    print(markdown(report))


def at(runs: list[dict[str, Any]], concurrency: int) -> dict[str, Any] | None:
    return next((r for r in runs if r["concurrency"] == concurrency), None)


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets as measured ratios (None where a run was skipped)."""
    load = report["load"]
    raw_max = max(r["images_per_s"] for r in report["forward"])
    raw_1 = next(r for r in report["forward"] if r["batch_size"] == 1)
    out: dict[str, Any] = {}
    service = load.get("service", [])
    if service:
        out["saturation_vs_raw"] = max(r["requests_per_s"] for r in service) / raw_max
        one = at(service, 1)
        if one:
            out["c1_p50_ms"] = one["p50_ms"]
            out["c1_budget_ms"] = raw_1["ms_per_batch"] + report["preprocess_ms"]["png-small"] + 3.0
    if service and load.get("unbatched") and at(service, 32) and at(load["unbatched"], 32):
        out["vs_unbatched_c32"] = at(service, 32)["requests_per_s"] / at(load["unbatched"], 32)["requests_per_s"]  # type: ignore[index]
    multi, peer = load.get("service-multipart", []), load.get("litserve", [])
    if multi and peer and at(multi, 32) and at(peer, 32):
        out["vs_litserve_c32"] = at(multi, 32)["requests_per_s"] / at(peer, 32)["requests_per_s"]  # type: ignore[index]
        out["p99_vs_litserve_c32"] = at(multi, 32)["p99_ms"] / at(peer, 32)["p99_ms"]  # type: ignore[index]
    if service and load.get("service-rollout") and at(service, 1):
        out["rollout_vs_plain_c1_p50"] = load["service-rollout"][0]["p50_ms"] / at(service, 1)["p50_ms"]  # type: ignore[index]
    return out


def markdown(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["settings"]
    lines = [
        f"Machine: {m['processor']}, {m['cpus']} torch threads, {m['device']}{' (' + m['gpu'] + ')' if m['gpu'] else ''}, torch {m['torch']}",
        f"Model {s['model_version']}, max batch {s['max_batch_size']}, wait {s['wait_ms']} ms, {s['duration_s']} s per level",
        "",
        "| batch size | forward img/s | ms/batch |",
        "|---:|---:|---:|",
        *[f"| {r['batch_size']} | {r['images_per_s']:.0f} | {r['ms_per_batch']:.2f} |" for r in report["forward"]],
        "",
        "| preprocessing (decode + resize + normalise) | ms/image |",
        "|---|---:|",
        *[f"| {k} | {v:.3f} |" for k, v in report["preprocess_ms"].items()],
        "",
        "| server | concurrency | req/s | p50 ms | p90 ms | p99 ms | errors | mean batch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in report["load"].items():
        for r in runs:
            batch = f"{r['mean_batch_size']:.2f}" if r["mean_batch_size"] else "-"
            lines.append(
                f"| {name} | {r['concurrency']} | {r['requests_per_s']:.1f} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | "
                f"{r['p99_ms']:.2f} | {r['errors']} | {batch} |"
            )
    lines += ["", "| target | measured |", "|---|---:|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in report["targets"].items()]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in report["load"].items():
        if len(runs) < 2:
            continue
        cs = [r["concurrency"] for r in runs]
        ax1.plot(cs, [r["requests_per_s"] for r in runs], marker="o", label=name)
        ax2.plot(cs, [r["p99_ms"] for r in runs], marker="o", label=name)
    raw_max = max(r["images_per_s"] for r in report["forward"])
    ax1.axhline(raw_max, linestyle="--", color="grey", label="raw forward (max batch)")
    ax1.set(xscale="log", xlabel="concurrency", ylabel="requests/s", title="Throughput")
    ax2.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="p99 latency (ms)", title="p99 latency")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
