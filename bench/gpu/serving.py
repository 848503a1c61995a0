"""The service (and LitServe, the peer) under `hey` on the GPU, per variant, with CPU, GPU and py-spy samples."""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.common import multipart
from bench.gpu.common import MODELS, VARIANTS, save
from bench.gpu.report import summarize_profile
from bench.run import check_peer
from harness.cpu import process_cpu_s
from harness.images import photo_jpeg
from harness.load import ServerProcess, cpu_decode_share, run_hey, start_litserve, v2_body
from harness.models import VIT_S16_PREPROCESSING
from harness.server import Server
from model.checkpoint import save_checkpoint
from model.vit import ViT


class Sampler:
    """Mean GPU utilisation (nvidia-smi) and the server's CPU use (cores busy) while load runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.samples, self.running = pid, [], True
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self) -> Sampler:
        self.cpu0, self.t0 = process_cpu_s(self.pid), time.perf_counter()
        self.thread.start()
        return self

    def run(self) -> None:
        while self.running and shutil.which("nvidia-smi"):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            ).stdout
            if out.strip().isdigit():
                self.samples.append(int(out.strip()))
            time.sleep(0.25)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self.cores = (process_cpu_s(self.pid) - self.cpu0) / (time.perf_counter() - self.t0)
        self.gpu_util = statistics.mean(self.samples) if self.samples else float("nan")


def load_levels(
    server: ServerProcess,
    route: str,
    body: Path,
    ctype: str,
    levels: list[int],
    seconds: float,
    images: int,
    label: str,
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for c in levels:
        with Sampler(server.proc.pid) as sampled:
            r = run_hey(server.url + route, body, ctype, c, seconds, headers)
        row = {
            **r.__dict__,
            "images_per_s": r.requests_per_s * images,
            "gpu_util": sampled.gpu_util,
            "server_cores": sampled.cores,
        }
        print(
            f"  {label:<28} c={c:<4} {row['images_per_s']:8.0f} img/s  p50 {r.p50_ms:7.1f}  p99 {r.p99_ms:7.1f} ms  "
            f"errors {r.errors}  batch {r.mean_batch_size or float('nan'):6.1f}  gpu {sampled.gpu_util:4.0f} %  "
            f"server cores {sampled.cores:4.1f}",
            flush=True,
        )
        rows.append(row)
    return rows


def bodies(folder: Path, images: int) -> tuple[str, dict[str, str]]:
    """folder/form (a multipart /predict body) and folder/v2 (a V2 binary body of `images` JPEGs):
    the multipart content type and the V2 headers."""
    files = [photo_jpeg(i) for i in range(images)]
    form, form_type = multipart(files[0], "photo.jpg", "image/jpeg")
    (folder / "form").write_bytes(form)
    v2, headers = v2_body(files)
    (folder / "v2").write_bytes(v2)
    return form_type, headers


def random_checkpoint(folder: Path, name: str) -> Path:
    checkpoint = folder / f"{name}.safetensors"
    torch.manual_seed(0)
    save_checkpoint(
        checkpoint,
        ViT(MODELS[name]).eval(),
        [f"class_{i}" for i in range(1000)],
        VIT_S16_PREPROCESSING,
        {"note": "random weights, for speed measurements only"},
    )
    return checkpoint


def start_server(args: argparse.Namespace, checkpoint: Path, variant: str) -> Server:
    return Server(
        checkpoint,
        VIT_DEVICE="auto",
        VIT_MAX_BATCH_SIZE=str(args.max_batch_size),
        VIT_MAX_WAIT_MS=str(args.wait_ms),
        VIT_MAX_QUEUE="8192",
        VIT_MAX_FILES="64",
        VIT_LOG_LEVEL="warning",
        VIT_GRPC_PORT="0",
        # every variant before the share's sweep decoded on the GPU alone: they measure that still
        **{"VIT_CPU_DECODE_SHARE": "0", **VARIANTS[variant]},
    )


def batch_totals(url: str, name: str) -> dict[str, int]:
    """The model's forward passes so far, their images, and the nanoseconds of each stage (V2 statistics)."""
    totals = {"batches": 0, "images": 0, "input_ns": 0, "infer_ns": 0, "output_ns": 0}
    for version in httpx.get(f"{url}/v2/models/{name}/stats", timeout=30).json()["model_stats"]:
        for b in version["batch_stats"]:
            n = b["compute_infer"]["count"]
            totals["batches"] += n
            totals["images"] += n * b["batch_size"]
            for stage in ("input", "infer", "output"):
                totals[f"{stage}_ns"] += b[f"compute_{stage}"]["ns"]
    return totals


def timeline(before: dict[str, int], after: dict[str, int], seconds: float) -> dict[str, Any]:
    """Per batch, in ms: the input stage (copies, or JPEGs decoded on the GPU), the forward (with the copy back),
    the outputs, and the cycle (the wall time between batches); and which bound holds. With two batches in
    flight the device keeps up with a cycle of the longer of its two stages: a cycle much longer than that
    waits on the host (the engine's loop, the front-ends). The stages are timed on the host: GPU work that runs
    asynchronously lands in the stage that waits for it (a decode still running when the forward starts, in the
    forward)."""
    batches = after["batches"] - before["batches"]
    if not batches:
        return {"batches": 0}
    ms = {
        stage: (after[f"{stage}_ns"] - before[f"{stage}_ns"]) / batches / 1e6 for stage in ("input", "infer", "output")
    }
    cycle = seconds * 1e3 / batches
    device = max(ms["input"], ms["infer"] + ms["output"])
    return {
        "batches": batches,
        "mean_batch": (after["images"] - before["images"]) / batches,
        **{f"{stage}_ms": v for stage, v in ms.items()},
        "cycle_ms": cycle,
        "bound": "the device" if cycle <= 1.15 * device else "the host (the engine's loop, the front-ends)",
    }


def profile(args: argparse.Namespace, folder: Path, seconds: float = 8.0) -> dict[str, Any]:
    """Under load at saturation (the last model and variant): the per-batch timeline from the service's own
    statistics (`timeline`), and py-spy samples of the served processes, every active thread and only the
    threads holding the GIL. Collapsed stacks go to DIR/profile-*.txt."""
    form_type, v2_headers = bodies(folder, args.images_per_request)
    name = args.models[-1]
    server = start_server(args, random_checkpoint(folder, name), args.variants[-1])
    result: dict[str, Any] = {"model": name}
    try:
        server.wait_ready(300)
        loads = {
            "v2": (f"/v2/models/{name}/infer", folder / "v2", "application/octet-stream", 64, v2_headers),
            "predict": ("/predict", folder / "form", form_type, 256, None),
        }
        for kind, (route, body, ctype, c, headers) in loads.items():
            for gil in (False, True):
                target = args.out / f"profile-{kind}{'-gil' if gil else ''}.txt"
                argv = [
                    "py-spy",
                    "record",
                    "--format",
                    "raw",
                    "--rate",
                    "250",
                    "--duration",
                    str(int(seconds)),
                    "--nonblocking",
                    "--threads",
                    "--subprocesses",  # the engine and the front-ends, not only the supervisor
                    "-o",
                    str(target),
                    "-p",
                    str(server.proc.pid),
                    *(["--gil"] if gil else []),
                ]
                spy = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                before, started = batch_totals(server.url, name), time.perf_counter()
                r = run_hey(server.url + route, body, ctype, c, seconds + 2, headers)
                after, took = batch_totals(server.url, name), time.perf_counter() - started
                spy_out = spy.communicate()[0]
                result[f"{kind}{'-gil' if gil else ''}"] = {
                    "requests_per_s": r.requests_per_s,
                    "timeline": timeline(before, after, took),
                    "cores": summarize_profile(target, seconds) if target.is_file() else {},
                    "py_spy": spy_out[-500:],
                }
                print(f"  profiled {kind} c={c} gil={gil}: {r.requests_per_s:.0f} req/s; {spy_out[-200:]}", flush=True)
    finally:
        server.stop()
    return result


def peer(
    args: argparse.Namespace,
    checkpoint: Path,
    config: str,
    predict_levels: Callable[[ServerProcess, str], list[dict[str, Any]]],
    folder: Path,
    form_type: str,
) -> dict[str, Any]:
    """LitServe on `config` ("APIxWORKERS": num_api_servers x workers_per_device), each worker one torch
    thread, `fast_queue`, the same batch settings, and each batch's JPEGs decoded on the GPU in `batch()` with
    the service's decoder; checked, then loaded as the service's /predict is."""
    api_servers, workers = (int(n) for n in config.split("x"))
    started = time.perf_counter()
    server = start_litserve(checkpoint, args.max_batch_size, args.wait_ms, 1, "torch", api_servers, workers, "gpu")
    try:
        startup = time.perf_counter() - started
        check_peer(server, folder / "form", form_type, 1, "torch", "gpu")
        print(f"== litserve {config}: ready in {startup:.1f} s")
        return {
            "startup_s": startup,
            "configuration": {
                "litserve": metadata.version("litserve"),  # the server runs in this interpreter
                "num_api_servers": api_servers,
                "workers_per_device": workers,
                "fast_queue": api_servers > 1 or workers > 1,
                "torch_threads_per_worker": 1,
                "max_batch_size": args.max_batch_size,
                "batch_timeout_ms": args.wait_ms,
                "decode": "GPU, in batch(): torchvision nvJPEG + the checkpoint's resize, crop, normalise",
                "model": "eager, bf16",
            },
            "predict": predict_levels(server, f"litserve {config} /predict"),
        }
    finally:
        server.stop()


def served(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    form_type, v2_headers = bodies(folder, args.images_per_request)
    result: dict[str, Any] = {
        "settings": {
            k: getattr(args, k)
            for k in (
                "max_batch_size",
                "wait_ms",
                "images_per_request",
                "duration",
                "predict_concurrency",
                "v2_concurrency",
            )
        }
    }

    def predict_levels(server: ServerProcess, label: str) -> list[dict[str, Any]]:
        """One image a request to /predict, as a multipart form, at each concurrency."""
        return load_levels(
            server, "/predict", folder / "form", form_type, args.predict_concurrency, args.duration, 1, label
        )

    for name in args.models:
        checkpoint = random_checkpoint(folder, name)
        result[name] = {}
        for variant in args.variants:
            started = time.perf_counter()
            server = start_server(args, checkpoint, variant)
            try:
                server.wait_ready(300)
                startup = time.perf_counter() - started
                info = httpx.get(server.url + "/v1/model").json()
                print(f"== {name} {variant}: ready in {startup:.1f} s on {info['device']} ({info['dtype']})")
                result[name][variant] = {
                    "startup_s": startup,
                    "predict": predict_levels(server, f"{variant} /predict"),
                    "v2": load_levels(
                        server,
                        f"/v2/models/{name}/infer",
                        folder / "v2",
                        "application/octet-stream",
                        args.v2_concurrency,
                        args.duration,
                        args.images_per_request,
                        f"{variant} V2 x{args.images_per_request}",
                        v2_headers,
                    ),
                    "cpu_decode_share": cpu_decode_share(server.url),  # where the loads left it (auto moves it)
                }
            finally:
                log = server.stop()
                with (args.out / "servers.log").open("a") as f:
                    f.write(f"== {name} {variant}\n{log[-20000:]}\n")
        if args.peer and name in args.peer_models:
            for config in args.peer_configs:
                result[name][f"litserve-{config}"] = peer(args, checkpoint, config, predict_levels, folder, form_type)
        save(args.out, "served", result)
    return result
