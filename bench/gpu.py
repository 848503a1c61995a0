"""The GPU benchmark: ceilings, raw forward (eager, compiled, CUDA graphs), preprocessing, and served throughput
against LitServe. Run it through `bash bench/gpu.sh run PARTS...` on a GPU machine (it installs what it needs).

    python -m bench.gpu --out DIR tests smoke ceilings decode raw served --peer   # what gpu-h100.md holds
    python -m bench.gpu --out DIR served --models vit-b16 --variants cpu-decode gpu-decode
    python -m bench.gpu --report DIR --name gpu-h100       # bench/results/gpu-h100.json and .md

Parts, each writing DIR/<part>.json (and a log) as it finishes, so a run cut short keeps what it measured:
  tests     the GPU tests (tests/app/test_cuda.py) under pytest
  smoke     the service on VIT_DEVICE=auto: /v1/model, /predict (with a map), V2, printed
  ceilings  the card's measured bf16 matmul rate and device-memory bandwidth
  raw       FLOPs per image, and the forward rate of ViT-S/16 and ViT-B/16 in bf16 at batch 1 to 512:
            eager, torch.compile, and compiled + CUDA graphs
  decode    preprocessing rate of 500x375 JPEGs: PIL on N CPU threads, and nvJPEG + tensor resize on the GPU
  served    the service under `hey` (/predict multipart, V2 binary with several images per request), per
            variant, and LitServe with the same model and batch settings as the peer
  profile   py-spy samples of the served process at saturation, all threads and those holding the GIL
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.batch import photo_jpeg
from bench.run import RESULTS, check_peer, multipart
from harness.load import ServerProcess, run_hey, start_litserve
from harness.models import VIT_S16, VIT_S16_PREPROCESSING
from harness.server import Server
from model.checkpoint import save_checkpoint
from model.vit import ViT, ViTConfig

VIT_B16 = ViTConfig(image_size=224, patch_size=16, dim=768, depth=12, heads=12, num_classes=1000, norm_eps=1e-6)
MODELS = {"vit-s16": VIT_S16, "vit-b16": VIT_B16}
PARTS = ("tests", "smoke", "ceilings", "raw", "decode", "served", "profile")
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# What each served variant sets beyond the common settings (VIT_DEVICE=auto, batch size, wait, queue).
VARIANTS: dict[str, dict[str, str]] = {
    "cpu-decode": {"VIT_DECODE": "cpu", "VIT_CUDA_GRAPHS": "false"},  # the GPU path before either change
    "gpu-decode": {"VIT_DECODE": "auto", "VIT_CUDA_GRAPHS": "false"},
    "gpu-decode+graphs": {"VIT_DECODE": "auto", "VIT_CUDA_GRAPHS": "true"},  # the defaults
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="*", metavar="PART", help=f"any of {', '.join(PARTS)}")
    p.add_argument("--out", type=Path, default=Path("gpu-out"))
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["vit-s16", "vit-b16"])
    p.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    p.add_argument("--compile-batches", type=int, nargs="+", default=[1, 8, 32, 128, 256, 512])
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--predict-concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--v2-concurrency", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--images-per-request", type=int, default=8, help="images in each V2 request")
    p.add_argument("--duration", type=float, default=6.0, help="seconds per load level")
    p.add_argument("--peer", action="store_true", help="also serve with LitServe (the peer)")
    p.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="write bench/results/<name>.json and .md from the parts' JSON in these folders (later wins)",
    )
    p.add_argument("--name", default="gpu-h100", help="results file name for --report")
    args = p.parse_args()
    if unknown := [part for part in args.parts if part not in PARTS]:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return args


def save(out: Path, part: str, result: dict[str, Any]) -> None:
    (out / f"{part}.json").write_text(json.dumps(result, indent=2))


def median_ms(fn: Callable[[], object], min_s: float = 0.3, inner: int = 5) -> float:
    """Median of timed groups of `inner` calls, in ms per call, timed with CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < min_s or len(times) < 5:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / inner)
    return statistics.median(times)


# -- ceilings ---------------------------------------------------------------------------------------------


def ceilings() -> dict[str, Any]:
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = median_ms(lambda: a @ b, 1.0)
    elements = 2**30  # 1 GiB of float32 read, 1 GiB written
    src = torch.randn(elements // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 1.0)
    result = {
        "matmul_bf16_tflops": 2 * n**3 / ms / 1e9,
        "copy_tb_per_s": 2 * src.numel() * 4 / copy_ms / 1e9,
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
    }
    print(f"ceilings: bf16 matmul {result['matmul_bf16_tflops']:.0f} TFLOP/s, copy {result['copy_tb_per_s']:.2f} TB/s")
    return result


# -- raw forward --------------------------------------------------------------------------------------------


def model_on_gpu(config: ViTConfig, seed: int = 0) -> ViT:
    torch.manual_seed(seed)
    return ViT(config).to("cuda", torch.bfloat16).eval()


def flops_per_image(model: ViT, config: ViTConfig) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(1, 3, config.image_size, config.image_size, device="cuda", dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model.forward_with_embedding(x)
    return float(counter.get_total_flops())


def check_close(fn: Callable[[torch.Tensor], Any], model: ViT, config: ViTConfig) -> float:
    """‖fn(x) - fp32(x)‖ / ‖fp32(x)‖ on fresh random input: the bf16 path against the fp32 model."""
    x = torch.randn(8, 3, config.image_size, config.image_size, device="cuda")
    reference = ViT(config).to("cuda").eval()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.inference_mode():
        want = reference.forward_with_embedding(x)[0].double()
        got = fn(x.bfloat16())[0].double()
    return float((got - want).norm() / want.norm())


def raw(models: list[str], batches: list[int], compile_batches: list[int]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name in models:
        config = MODELS[name]
        model = model_on_gpu(config)

        def eager(x: torch.Tensor, model: ViT = model) -> tuple[torch.Tensor, torch.Tensor]:
            logits, embedding, _ = model.forward_with_embedding(x)
            return logits, embedding

        flops = flops_per_image(model, config)
        started = time.perf_counter()
        compiled = torch.compile(eager)
        rows: dict[str, dict[int, float]] = {"eager": {}, "compiled": {}, "eager+graphs": {}, "compiled+graphs": {}}
        errors = {"eager": check_close(eager, model, config)}
        with torch.inference_mode():
            for bs in batches:
                xs = [
                    torch.randn(bs, 3, config.image_size, config.image_size, device="cuda", dtype=torch.bfloat16)
                    for _ in range(3)
                ]
                turn = iter(range(10**9))
                rows["eager"][bs] = bs / median_ms(lambda xs=xs, t=turn: eager(xs[next(t) % 3])) * 1e3
                rows["eager+graphs"][bs] = bs / graph_ms(eager, xs[0]) * 1e3
                if bs in compile_batches:
                    rows["compiled"][bs] = bs / median_ms(lambda xs=xs, t=turn, f=compiled: f(xs[next(t) % 3])) * 1e3
                    rows["compiled+graphs"][bs] = bs / graph_ms(compiled, xs[0]) * 1e3
                print(
                    f"  {name} batch {bs:>4}: "
                    + "  ".join(f"{k} {v[bs]:8.0f}" for k, v in rows.items() if bs in v)
                    + " img/s",
                    flush=True,
                )
        errors["compiled"] = check_close(compiled, model, config)
        result[name] = {
            "gflops_per_image": flops / 1e9,
            "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "img_per_s": rows,
            "relative_error_vs_fp32": errors,
            "compile_and_runs_s": time.perf_counter() - started,
        }
        best = max(max(v.values()) for v in rows.values() if v)
        print(
            f"  {name}: {flops / 1e9:.2f} GFLOP/image, best {best:.0f} img/s = "
            f"{best * flops / 1e12:.0f} TFLOP/s; rel. error vs fp32 {errors}"
        )
        del model, compiled
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return result


def graph_ms(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> float:
    """Milliseconds per replay of `fn(x)` captured as one CUDA graph (NaN where capture fails)."""
    try:
        return captured_ms(fn, x)
    except RuntimeError as e:
        print(f"  CUDA graph capture failed: {e}")
        return float("nan")


def captured_ms(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> float:
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(static)
    return median_ms(graph.replay)


# -- preprocessing ------------------------------------------------------------------------------------------


def decode(images: int = 512, batch: int = 64) -> dict[str, Any]:
    from app.core.decode import decode_image
    from app.core.gpu_decode import GpuJpegDecoder, Jpeg
    from app.core.preprocess import Preprocessor

    files = [photo_jpeg(i) for i in range(images)]
    cpu = Preprocessor(VIT_S16_PREPROCESSING)

    def on_cpu(data: bytes) -> torch.Tensor:
        return cpu(decode_image(data, "x.jpg", 3, 10**8))

    result: dict[str, Any] = {"image": "500x375 JPEG, quality 90", "cpu_img_per_s": {}}
    for threads in (1, 8, 16):
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(on_cpu, files[:32]))
            started = time.perf_counter()
            list(pool.map(on_cpu, files))
            result["cpu_img_per_s"][threads] = images / (time.perf_counter() - started)
    gpu = GpuJpegDecoder(VIT_S16_PREPROCESSING, torch.device("cuda"), lambda j: on_cpu(j.data))
    jpegs = [Jpeg(f, f"{i}.jpg") for i, f in enumerate(files)]
    chunks = [jpegs[i : i + batch] for i in range(0, images, batch)]

    def run(decode_only: bool) -> float:
        gpu(chunks[0])
        torch.cuda.synchronize()
        started = time.perf_counter()
        for chunk in chunks:
            gpu.decode([j.data for j in chunk]) if decode_only else gpu(chunk)
        torch.cuda.synchronize()
        return images / (time.perf_counter() - started)

    result["gpu_batch"] = batch
    result["gpu_decode_img_per_s"] = run(decode_only=True)
    result["gpu_decode_resize_img_per_s"] = run(decode_only=False)
    want = torch.stack([on_cpu(f) for f in files[:64]]).cuda()
    got = gpu(jpegs[:64])
    result["max_abs_diff_vs_cpu"] = float((got - want).abs().max())
    result["mean_abs_diff_vs_cpu"] = float((got - want).abs().mean())
    print("decode:", json.dumps(result))
    return result


# -- served -------------------------------------------------------------------------------------------------


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


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children, from /proc."""
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def children(pid: int) -> list[int]:
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in children(k)]


def v2_body(files: list[bytes]) -> tuple[bytes, int]:
    binary = b"".join(len(f).to_bytes(4, "little") + f for f in files)
    header = {
        "inputs": [
            {
                "name": "image",
                "datatype": "BYTES",
                "shape": [len(files)],
                "parameters": {"binary_data_size": len(binary)},
            }
        ],
        "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}],
    }
    head = json.dumps(header).encode()
    return head + binary, len(head)


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
    v2, header_length = v2_body(files)
    (folder / "v2").write_bytes(v2)
    return form_type, {"Inference-Header-Content-Length": str(header_length)}


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
        **VARIANTS[variant],
    )


def profile(args: argparse.Namespace, folder: Path, seconds: float = 8.0) -> dict[str, Any]:
    """py-spy samples of the served process at saturation (the last model and variant): every active thread,
    and only the threads holding the GIL. Collapsed stacks go to DIR/profile-*.txt."""
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
                    "-o",
                    str(target),
                    "-p",
                    str(server.proc.pid),
                    *(["--gil"] if gil else []),
                ]
                spy = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                r = run_hey(server.url + route, body, ctype, c, seconds + 2, headers)
                spy_out = spy.communicate()[0]
                result[f"{kind}{'-gil' if gil else ''}"] = {
                    "requests_per_s": r.requests_per_s,
                    "py_spy": spy_out[-500:],
                }
                print(f"  profiled {kind} c={c} gil={gil}: {r.requests_per_s:.0f} req/s; {spy_out[-200:]}", flush=True)
    finally:
        server.stop()
    return result


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
                    "predict": load_levels(
                        server,
                        "/predict",
                        folder / "form",
                        form_type,
                        args.predict_concurrency,
                        args.duration,
                        1,
                        f"{variant} /predict",
                    ),
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
                }
            finally:
                log = server.stop()
                with (args.out / "servers.log").open("a") as f:
                    f.write(f"== {name} {variant}\n{log[-20000:]}\n")
        if args.peer:
            server = start_litserve(checkpoint, args.max_batch_size, args.wait_ms, 0, "torch")
            try:
                check_peer(server, folder / "form", form_type, 0, "torch")
                result[name]["litserve"] = {
                    "predict": load_levels(
                        server,
                        "/predict",
                        folder / "form",
                        form_type,
                        args.predict_concurrency,
                        args.duration,
                        1,
                        "litserve /predict",
                    )
                }
            finally:
                server.stop()
        save(args.out, "served", result)
    return result


# -- tests and smoke ----------------------------------------------------------------------------------------


def tests(out: Path) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "tests/app/test_cuda.py",
        "-v",
        "-p",
        "no:cacheprovider",
        "-rA",
        "--tb=short",
        "--show-capture=no",
    ]
    run = subprocess.run(argv, capture_output=True, text=True)
    print(run.stdout, run.stderr)
    return {"returncode": run.returncode, "summary": run.stdout.strip().splitlines()[-1] if run.stdout else ""}


def smoke(folder: Path) -> dict[str, Any]:
    """The service on VIT_DEVICE=auto with the bundled model: what each route answers, verbatim."""
    from app.settings import BUNDLED_WEIGHTS
    from harness.images import encode
    from model.shapes import make_sample

    pngs = [encode(make_sample(7, i).image) for i in range(2)]
    server = Server(BUNDLED_WEIGHTS, VIT_DEVICE="auto", VIT_GRPC_PORT="0")
    out: dict[str, Any] = {}
    try:
        server.wait_ready(300)
        files = [("files", (f"{i}.png", png, "image/png")) for i, png in enumerate(pngs)]
        out["v1_model"] = httpx.get(server.url + "/v1/model").json()
        out["predict"] = httpx.post(server.url + "/predict", files=files, params={"top_k": 2}).json()
        mapped = httpx.post(server.url + "/predict", files=files[:1], params={"attention": "rollout", "top_k": 1})
        out["predict_rollout"] = mapped.json()
        v2 = {
            "inputs": [
                {"name": "image", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(pngs[0]).decode()]}
            ]
        }
        out["v2"] = httpx.post(server.url + "/v2/models/vit-shapes/infer", json=v2).json()
        out["metrics_batches"] = [
            line
            for line in httpx.get(server.url + "/metrics").text.splitlines()
            if line.startswith("vit_batch_size_count")
        ]
    finally:
        out["log"] = server.stop()[-4000:]
    print(json.dumps({k: v for k, v in out.items() if k != "log"}, indent=1)[:6000])
    print(out["log"])
    return out


def main() -> None:
    args = parse_args()
    if args.report:
        report(args.report, args.name)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts:
            started = time.perf_counter()
            print(f"=== {part}", flush=True)
            try:
                if part == "tests":
                    result = tests(args.out)
                elif part == "smoke":
                    result = smoke(Path(tmp))
                elif part == "ceilings":
                    result = ceilings()
                elif part == "raw":
                    result = raw(args.models, args.batches, args.compile_batches)
                elif part == "decode":
                    result = decode()
                elif part == "profile":
                    result = profile(args, Path(tmp))
                else:
                    result = served(args, Path(tmp))
            except Exception as e:  # a broken part must not cost the others their device time
                import traceback

                traceback.print_exc()
                result = {"error": repr(e)}
            result["seconds"] = time.perf_counter() - started
            save(args.out, part, result)
            print(f"=== {part} done in {result['seconds']:.0f} s", flush=True)


# -- the report ---------------------------------------------------------------------------------------------


def summarize_profile(path: Path) -> dict[str, float]:
    """Share of wall time each thread of the server was sampled in (py-spy raw output, 250 Hz)."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        thread = (
            "forward thread"
            if "Predictor.__call__" in stack
            else "cpu pool"
            if "_WorkItem.run" in stack
            else "event loop"
        )
        counts[thread] = counts.get(thread, 0) + int(n)
    return {k: v / (250 * 8) for k, v in sorted(counts.items())}


def report(folders: list[Path], name: str) -> None:
    data: dict[str, Any] = {}
    for folder in folders:
        for part in ("ceilings", "decode", "raw", "served", "tests"):
            if (folder / f"{part}.json").is_file():
                data[part] = json.loads((folder / f"{part}.json").read_text())
        if (folder / "gpu.txt").is_file():
            data["machine"] = (folder / "gpu.txt").read_text().strip()
        for kind in ("v2", "predict"):
            for gil in ("", "-gil"):
                found = folder / f"profile-{kind}{gil}.txt"
                if found.is_file():
                    data.setdefault("profile", {})[f"{kind}{gil}"] = summarize_profile(found)
    data["targets"] = targets(data)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown(data))
    print(markdown(data))


def models_in(part: dict[str, Any]) -> dict[str, Any]:
    """A part's per-model entries (not its settings or timing)."""
    return {k: v for k, v in part.items() if k in MODELS}


def best_served(model: dict[str, Any]) -> dict[str, Any]:
    rows = [
        r
        for variant, runs in model.items()
        if variant != "litserve" and isinstance(runs, dict)
        for route in ("predict", "v2")
        for r in runs.get(route, [])
    ]
    return max(rows, key=lambda r: r["images_per_s"])


def targets(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, model in models_in(data.get("served", {})).items():
        if name not in data.get("raw", {}):
            continue
        raw_rates = data["raw"][name]["img_per_s"]
        compiled_best = max(raw_rates["compiled"].values())
        served = best_served(model)
        out[name] = {
            "served_best_img_per_s": served["images_per_s"],
            "raw_compiled_best_img_per_s": compiled_best,
            "served_over_raw": served["images_per_s"] / compiled_best,
            "p99_ms_there": served["p99_ms"],
        }
        if "litserve" in model:  # LitServe decodes with PIL in its one inference worker, on the CPU
            out[name]["vs_litserve"] = {
                variant: {
                    r["concurrency"]: ours["images_per_s"] / r["images_per_s"]
                    for ours in model[variant]["predict"]
                    for r in model["litserve"]["predict"]
                    if r["concurrency"] == ours["concurrency"]
                }
                for variant in ("cpu-decode", "gpu-decode+graphs")
                if variant in model
            }
    return out


def markdown(d: dict[str, Any]) -> str:
    c, dec = d["ceilings"], d["decode"]
    lines = [
        f"{d.get('machine', '')}",
        "",
        "## Ceilings",
        "",
        f"bf16 matrix product (8192³): **{c['matmul_bf16_tflops']:.0f} TFLOP/s**; device-to-device copy: "
        f"**{c['copy_tb_per_s']:.2f} TB/s** (bytes read + written).",
        "",
        "## Raw forward, bf16 (img/s; logits and embedding, random input)",
        "",
    ]
    for name, r in models_in(d["raw"]).items():
        rates = r["img_per_s"]
        best = max(max(v.values()) for v in rates.values() if v)
        lines += [
            f"**{name}**: {r['parameters_m']:.1f} M parameters, {r['gflops_per_image']:.2f} GFLOP/image; best "
            f"{best:.0f} img/s = {best * r['gflops_per_image'] / 1e3:.0f} TFLOP/s "
            f"({best * r['gflops_per_image'] / 1e3 / c['matmul_bf16_tflops']:.0%} of the matmul ceiling); "
            f"relative error against fp32: eager {r['relative_error_vs_fp32']['eager']:.4f}, compiled "
            f"{r['relative_error_vs_fp32']['compiled']:.4f}",
            "",
            "| batch | eager | torch.compile | eager + CUDA graph | compiled + CUDA graph |",
            "|---:|---:|---:|---:|---:|",
        ]
        for bs in rates["eager"]:
            cells = [f"{rates[m][bs]:.0f}" if bs in rates[m] else "" for m in rates]
            lines.append(f"| {bs} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Preprocessing a 500x375 JPEG (decode, resize to 248, crop 224, normalise)",
        "",
        "| where | img/s |",
        "|---|---:|",
        *[f"| PIL on {t} CPU thread{'s' if t != '1' else ''} | {v:.0f} |" for t, v in dec["cpu_img_per_s"].items()],
        f"| nvJPEG, batches of {dec['gpu_batch']}: decode only | {dec['gpu_decode_img_per_s']:.0f} |",
        f"| nvJPEG + resize on the GPU | {dec['gpu_decode_resize_img_per_s']:.0f} |",
        "",
        f"GPU pixels against the CPU path's (normalised units): mean |diff| {dec['mean_abs_diff_vs_cpu']:.4f}, "
        f"max {dec['max_abs_diff_vs_cpu']:.3f}.",
        "",
    ]
    sv = d["served"]
    st = sv["settings"]
    lines += [
        "## Served (500x375 JPEGs; `hey`; /predict: one image per multipart request; V2: "
        f"{st['images_per_request']} images per binary request)",
        "",
        f"VIT_MAX_BATCH_SIZE={st['max_batch_size']}, VIT_MAX_WAIT_MS={st['wait_ms']}, {st['duration']} s per "
        "level. *server cores*: CPU seconds the server process used per second; *GPU*: nvidia-smi utilisation.",
        "",
        "| model | server | route | concurrency | img/s | p50 ms | p99 ms | mean batch | GPU % | server cores |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, model in models_in(sv).items():
        for variant, runs in model.items():
            if not isinstance(runs, dict):
                continue
            for route in ("predict", "v2"):
                for r in runs.get(route, []):
                    batch = f"{r['mean_batch_size']:.0f}" if r["mean_batch_size"] else "-"
                    lines.append(
                        f"| {name} | {variant} | {route} | {r['concurrency']} | {r['images_per_s']:.0f} | "
                        f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {batch} | {r['gpu_util']:.0f} | "
                        f"{r['server_cores']:.1f} |"
                    )
        starts = ", ".join(f"{v} {runs['startup_s']:.1f} s" for v, runs in model.items() if "startup_s" in runs)
        lines.append(f"| {name} | startup (process start to ready) | {starts} | | | | | | | |")
    lines += [
        "",
        "## Targets",
        "",
        "LitServe decodes each upload with PIL on the CPU in its one inference worker: the fair ratio is against "
        "the service's own CPU decoding (*cpu-decode*); the defaults decode JPEGs on the GPU (nvJPEG).",
        "",
        "| model | served best img/s | raw compiled best | served / raw | p99 there | "
        "/predict vs LitServe, both decoding on the CPU | /predict vs LitServe, the defaults (GPU decoding) |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, t in d["targets"].items():
        peer = t.get("vs_litserve", {})
        if peer and not isinstance(next(iter(peer.values())), dict):  # a result file from before the split
            peer = {"gpu-decode+graphs": peer}

        def ratios(variant: str, peer: dict[str, Any] = peer) -> str:
            return ", ".join(f"c={k}: {v:.1f}x" for k, v in peer.get(variant, {}).items())

        lines.append(
            f"| {name} | {t['served_best_img_per_s']:.0f} | {t['raw_compiled_best_img_per_s']:.0f} | "
            f"{t['served_over_raw']:.2f} | {t['p99_ms_there']:.0f} ms | {ratios('cpu-decode')} | "
            f"{ratios('gpu-decode+graphs')} |"
        )
    if "profile" in d:
        lines += [
            "",
            "## Where the served process spends its time (py-spy, 8 s at 250 Hz, vit-b16 with the defaults)",
            "",
            "Share of wall time each thread was sampled running; *holding the GIL*: sampled with `--gil`.",
            "",
            "| load | event loop | CPU pool | forward thread |",
            "|---|---:|---:|---:|",
        ]
        for kind, shares in d["profile"].items():
            label = (
                kind.replace("-gil", ", holding the GIL")
                .replace("predict", "/predict c=256")
                .replace("v2", "V2 x8 c=64")
            )
            lines.append(
                f"| {label} | {shares.get('event loop', 0):.0%} | {shares.get('cpu pool', 0):.0%} | "
                f"{shares.get('forward thread', 0):.0%} |"
            )
    if "tests" in d:
        lines += ["", f"GPU tests (`tests/app/test_cuda.py`): {d['tests']['summary'].strip('= ')}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
