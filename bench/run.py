"""One run of the serving benchmark; writes bench/results/<name>.json and .md.

    python -m bench.run --threads 1 --attention --duration 8 --name cpu     # bundled checkpoint, both backends
    python -m bench.run --model vit-s16 --threads 1 --concurrency 1 8 32 --duration 20 --name cpu-vit-s16
    python -m bench.run --duration 5 --concurrency 1 8 32 --backends onnxruntime --no-litserve

For each backend, on the same machine and in this order: (1) the limit: the backend's forward pass
alone on pre-made tensors at each batch size (and, once, the per-image preprocessing cost); (2) the
service under `hey`, posting raw image bytes, then a multipart body, at each concurrency; (3) the
service with batching off; (4) LitServe running the same backend, posting the same multipart body.
Compare ratios within one run: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import torch

from app.choices import Backend
from app.settings import BUNDLED_WEIGHTS
from bench.common import RESULTS, multipart, sample_images, write_results
from bench.limits import forward_throughput, preprocessing_cost
from harness.load import LoadResult, ServerProcess, require_hey, run_hey, start_litserve, start_service
from harness.models import vit_s16_checkpoint
from harness.records import table
from model.checkpoint import load_checkpoint
from model.device import resolve_device

# ViT-S/16 at 224 px as timm builds it (22 M parameters), random weights: compute dominates, as with real models
DEFAULT_IMAGE = {"bundled": "png-small", "vit-s16": "jpeg-medium"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        choices=["bundled", "vit-s16"],
        default="bundled",
        help="the bundled checkpoint, or a random-weight ViT-S/16 at 224 px with 1,000 classes",
    )
    p.add_argument("--weights", type=Path, help="serve this checkpoint instead of --model")
    p.add_argument("--image", choices=sorted(sample_images()), help="the posted image (default: by model)")
    p.add_argument(
        "--backends",
        nargs="+",
        choices=["torch", "onnxruntime", "onnxruntime-int8"],
        help="default: both on the CPU, torch on a GPU",
    )
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per load level")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each server (0: default)")
    p.add_argument("--no-litserve", action="store_true", help="skip the LitServe peer")
    p.add_argument("--attention", action="store_true", help="also measure attention=rollout at concurrency 1")
    p.add_argument("--name", default="cpu", help="results file name")
    return p.parse_args()


def check_peer(
    server: ServerProcess, body: Path, content_type: str, threads: int, backend: str, decode: str = "cpu"
) -> int:
    """The torch threads, backend and decoding LitServe's inference worker really runs; they must be the service's."""
    r = httpx.post(
        server.url + "/predict", content=body.read_bytes(), headers={"content-type": content_type}, timeout=60
    )
    r.raise_for_status()
    if r.json()["decode"] != decode:
        raise SystemExit(f"LitServe's worker decodes on {r.json()['decode']}, the benchmark asked {decode}")
    worker: int = r.json()["worker_threads"]
    if threads and worker != threads:
        raise SystemExit(f"LitServe's worker runs {worker} torch threads, the service {threads}: not a fair peer")
    if r.json()["backend"] != backend:
        raise SystemExit(f"LitServe's worker runs {r.json()['backend']}, the service {backend}: not a fair peer")
    print(f"  LitServe worker: {worker} torch threads, {backend} (checked)")
    return worker


def sweep(
    server: ServerProcess, path: str, body: Path, ctype: str, levels: list[int], seconds: float, label: str
) -> list[LoadResult]:
    results = []
    for c in levels:
        r = run_hey(server.url + path, body, ctype, c, seconds)
        print(
            f"  {label:<22} c={c:<4} {r.requests_per_s:8.1f} req/s  p50 {r.p50_ms:7.2f}  p99 {r.p99_ms:7.2f} ms  "
            f"errors {r.errors}  batch {r.mean_batch_size or float('nan'):.2f}",
            flush=True,
        )
        results.append(r)
    return results


def main() -> None:
    args = parse_args()
    require_hey()
    RESULTS.mkdir(exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device("auto")
    backends: list[Backend] = args.backends or (["torch", "onnxruntime"] if device.type == "cpu" else ["torch"])
    with tempfile.TemporaryDirectory() as tmp:
        weights = args.weights or (
            vit_s16_checkpoint(Path(tmp) / "vit-s16.safetensors") if args.model == "vit-s16" else BUNDLED_WEIGHTS
        )
        image_name = args.image or DEFAULT_IMAGE[args.model]
        ckpt = load_checkpoint(weights, device)
        report: dict[str, Any] = {
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "cpus": torch.get_num_threads(),
                "device": str(device),
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            },
            "settings": {
                "model": args.model if args.weights is None else str(args.weights),
                "model_version": ckpt.version,
                "parameters": sum(p.numel() for p in ckpt.model.parameters()),
                "image_size": ckpt.config.image_size,
                "classes": len(ckpt.classes),
                "image": image_name,
                "max_batch_size": args.max_batch_size,
                "wait_ms": args.wait_ms,
                "duration_s": args.duration,
                "threads": args.threads,
            },
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "preprocess_ms": preprocessing_cost(ckpt),
            "backends": {},
        }
        print("preprocess ms/image:", {k: round(v, 3) for k, v in report["preprocess_ms"].items()})
        del ckpt
        for backend in backends:
            preprocess_ms = report["preprocess_ms"][image_name]
            report["backends"][backend] = run_backend(args, weights, device, backend, image_name, preprocess_ms)
    write_results(args.name, report, markdown(report))


def run_backend(
    args: argparse.Namespace,
    weights: Path,
    device: torch.device,
    backend: Backend,
    image_name: str,
    preprocess_ms: float,
) -> dict[str, Any]:
    print(f"== backend {backend}")
    print("1. limit: forward throughput on pre-made tensors")
    ckpt = load_checkpoint(weights, device)
    forward = [asdict(r) for r in forward_throughput(ckpt, device, args.max_batch_size, backend)]
    del ckpt
    for r in forward:
        print(f"  batch {r['batch_size']:>4}: {r['images_per_s']:9.1f} img/s ({r['ms_per_batch']:.2f} ms)")
    image = sample_images()[image_name]
    suffix = "jpeg" if image_name.startswith("jpeg") else "png"
    raw_body, form_body = RESULTS / "body.image", RESULTS / "body.multipart"
    raw_body.write_bytes(image)
    form, form_type = multipart(image, f"image.{suffix}", f"image/{suffix}")
    form_body.write_bytes(form)
    levels, seconds, s = args.concurrency, args.duration, args
    runs: dict[str, list[LoadResult]] = {}
    try:
        print("2. service, batching on")
        server = start_service(weights, s.max_batch_size, s.wait_ms, s.threads, backend)
        try:
            runs["service"] = sweep(server, "/predict", raw_body, f"image/{suffix}", levels, seconds, "service")
            runs["service-multipart"] = sweep(
                server, "/predict", form_body, form_type, levels, seconds, "service (multipart)"
            )
            if args.attention:
                runs["service-rollout"] = sweep(
                    server, "/predict?attention=rollout", raw_body, f"image/{suffix}", [1], seconds, "service + rollout"
                )
        finally:
            server.stop()
        print("3. service, batching off (VIT_MAX_BATCH_SIZE=1)")
        server = start_service(weights, 1, s.wait_ms, s.threads, backend)
        try:
            runs["unbatched"] = sweep(server, "/predict", raw_body, f"image/{suffix}", levels, seconds, "unbatched")
        finally:
            server.stop()
        peer_threads = None
        if not args.no_litserve:
            print(f"4. LitServe, {backend}, same checkpoint and batch settings (multipart)")
            server = start_litserve(weights, s.max_batch_size, s.wait_ms, s.threads, backend)
            try:
                peer_threads = check_peer(server, form_body, form_type, s.threads, backend)
                runs["litserve"] = sweep(server, "/predict", form_body, form_type, levels, seconds, "litserve")
            finally:
                server.stop()
    finally:
        raw_body.unlink(missing_ok=True)
        form_body.unlink(missing_ok=True)
    result: dict[str, Any] = {"forward": forward, "litserve_worker_threads": peer_threads}
    result["load"] = {k: [asdict(r) for r in v] for k, v in runs.items()}
    result["targets"] = targets(result, preprocess_ms)
    return result


def at(runs: list[dict[str, Any]], concurrency: int) -> dict[str, Any] | None:
    return next((r for r in runs if r["concurrency"] == concurrency), None)


def targets(result: dict[str, Any], preprocess_ms: float) -> dict[str, float]:
    """The issue's targets as measured ratios, for one backend (absent where a run was skipped)."""
    load = result["load"]
    raw_max = max(r["images_per_s"] for r in result["forward"])
    raw_1 = next(r for r in result["forward"] if r["batch_size"] == 1)
    out: dict[str, float] = {}
    service, multi, peer = load.get("service", []), load.get("service-multipart", []), load.get("litserve", [])
    if service:
        out["saturation_vs_raw"] = max(r["requests_per_s"] for r in service) / raw_max
        one = at(service, 1)
        if one:
            out["c1_p50_ms"] = one["p50_ms"]
            out["c1_budget_ms"] = raw_1["ms_per_batch"] + preprocess_ms + 3.0
    unbatched = load.get("unbatched", [])
    for c in (8, 32):
        ours, off = at(service, c), at(unbatched, c)
        if ours and off:
            out[f"vs_unbatched_c{c}"] = ours["requests_per_s"] / off["requests_per_s"]
    for c in (8, 32, 128):
        ours, theirs = at(multi, c), at(peer, c)
        if ours and theirs:
            out[f"vs_litserve_c{c}"] = ours["requests_per_s"] / theirs["requests_per_s"]
            out[f"p99_vs_litserve_c{c}"] = ours["p99_ms"] / theirs["p99_ms"]
    if at(multi, 32):
        out["p99_over_p50_c32"] = at(multi, 32)["p99_ms"] / at(multi, 32)["p50_ms"]  # type: ignore[index]
    if load.get("service-rollout") and at(service, 1):
        out["rollout_vs_plain_c1_p50"] = load["service-rollout"][0]["p50_ms"] / at(service, 1)["p50_ms"]  # type: ignore[index]
    return out


def markdown(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["settings"]
    gpu = f" ({m['gpu']})" if m["gpu"] else ""
    lines = [
        f"Machine: {m['processor']}, {m['cpus']} torch threads, {m['device']}{gpu}, torch {m['torch']}",
        f"Model {s['model']} ({s['model_version']}, {s['parameters'] / 1e6:.1f} M parameters, {s['image_size']} px, "
        f"{s['classes']} classes), posting {s['image']}; max batch {s['max_batch_size']}, wait {s['wait_ms']} ms, "
        f"{s['duration_s']} s per level, started {report['started']}",
        "",
        *table(
            ["preprocessing (decode + resize + normalise)", "ms/image"],
            [[k, f"{v:.3f}"] for k, v in report["preprocess_ms"].items()],
        ),
    ]
    for backend, result in report["backends"].items():
        lines += [
            "",
            f"### Backend {backend}",
            "",
            *table(
                ["batch size", "forward img/s", "ms/batch"],
                [[r["batch_size"], f"{r['images_per_s']:.1f}", f"{r['ms_per_batch']:.2f}"] for r in result["forward"]],
                "rrr",
            ),
            "",
        ]
        rows = [
            [
                name,
                r["concurrency"],
                f"{r['requests_per_s']:.1f}",
                f"{r['p50_ms']:.2f}",
                f"{r['p90_ms']:.2f}",
                f"{r['p99_ms']:.2f}",
                r["errors"],
                f"{r['mean_batch_size']:.2f}" if r["mean_batch_size"] else "-",
            ]
            for name, runs in result["load"].items()
            for r in runs
        ]
        header = ["server", "concurrency", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors", "mean batch"]
        lines += table(header, rows)
        lines += ["", *table(["target", "measured"], [[k, f"{v:.3f}"] for k, v in result["targets"].items()])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
