"""Preprocessing 500x375 JPEGs: PIL on CPU threads against nvJPEG and the resize on the GPU."""

from __future__ import annotations

import functools
import io
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from PIL import Image

from app.core.images.decode import decode_image
from app.core.images.prepare import Preprocessor
from bench.gpu.engines import together as loops_together
from harness.images import photo_jpeg
from harness.models import VIT_S16_PREPROCESSING


def decode(images: int = 512, batch: int = 64) -> dict[str, Any]:
    from app.core.images.gpu_decode import GpuJpegDecoder, Jpeg, TorchvisionJpeg

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
    cuda = torch.device("cuda")
    gpu = GpuJpegDecoder(VIT_S16_PREPROCESSING, cuda, lambda j: on_cpu(j.data), TorchvisionJpeg(cuda))
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


def hardware(images: int = 1024, batches: tuple[int, ...] = (64, 256), seconds: float = 2.0) -> dict[str, Any]:
    """nvImageCodec's decoders on 500x375 JPEGs: the hardware JPEG engines (NVJPG), the CUDA decoder, splits
    between them, each alone and each beside a ViT-B/16 forward on the same GPU; their pixels against the
    CUDA path's and PIL's; which kinds of JPEG the hardware takes."""
    from nvidia import nvimgcodec as nv

    from app.core.images.gpu_decode import GpuJpegDecoder, NvImageCodecJpeg, TorchvisionJpeg
    from bench.gpu.common import VIT_B16
    from bench.gpu.kernels import capture
    from model.vit import ViT

    files = [photo_jpeg(i) for i in range(images)]
    streams = [nv.CodeStream(f) for f in files]
    params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB)
    hw, cuda = nv.BackendKind.HW_GPU_ONLY, nv.BackendKind.HYBRID_CPU_GPU
    configs: dict[str, list[Any]] = {
        "hardware": [nv.Backend(hw)],
        "cuda": [nv.Backend(cuda)],
        "split-0.5": [nv.Backend(hw, load_hint=0.5), nv.Backend(cuda)],
        "split-0.75": [nv.Backend(hw, load_hint=0.75), nv.Backend(cuda)],
        "split-0.9": [nv.Backend(hw, load_hint=0.9), nv.Backend(cuda)],
        "adaptive": [
            nv.Backend(hw, load_hint=0.75, load_hint_policy=nv.LoadHintPolicy.ADAPTIVE_MINIMIZE_IDLE_TIME),
            nv.Backend(cuda, load_hint_policy=nv.LoadHintPolicy.ADAPTIVE_MINIMIZE_IDLE_TIME),
        ],
    }
    result: dict[str, Any] = {"image": "500x375 JPEG, quality 90, 4:2:0", "nvimgcodec": nv.__version__, "alone": {}}
    decoders = {name: nv.Decoder(device_id=0, backends=backends) for name, backends in configs.items()}
    # the engines' buffers taken once for a batch of 256 photos up to 512x512, instead of per call
    ext = "nvjpeg_hw_decoder"
    preallocate = f"{ext}:preallocate_batch_size=256 {ext}:preallocate_width_hint=512 {ext}:preallocate_height_hint=512"
    decoders["hardware-preallocated"] = nv.Decoder(device_id=0, backends=configs["hardware"], options=preallocate)
    decoders["hardware-preallocated-4"] = nv.Decoder(
        device_id=0, max_num_cpu_threads=4, backends=configs["hardware"], options=preallocate
    )
    decoders["service"] = NvImageCodecJpeg(torch.device("cuda", 0)).decoder  # VIT_DECODE=nvimgcodec's

    def decode_all(decoder: Any, batch: int, stream: int = 0) -> int:
        done = 0
        for i in range(0, images, batch):
            out = decoder.decode(streams[i : i + batch], params=params, cuda_stream=stream)
            done += sum(o is not None for o in out)
        return done

    for name, decoder in decoders.items():
        if name == "service":
            continue
        result["alone"][name] = {}
        for batch in batches:
            try:
                decode_all(decoder, batch)
                torch.cuda.synchronize()
                started = time.perf_counter()
                done = decode_all(decoder, batch)
                torch.cuda.synchronize()
                result["alone"][name][batch] = {"img_per_s": images / (time.perf_counter() - started), "decoded": done}
            except Exception as e:  # a backend this GPU lacks: say so, keep measuring the others
                result["alone"][name][batch] = {"error": repr(e)}
        print("hwdecode:", name, json.dumps(result["alone"][name]), flush=True)

    # Beside the forward: a CUDA-graphed ViT-B/16 at batch 256 in bf16 on one stream, decoding on another.
    model = ViT(VIT_B16).cuda().to(torch.bfloat16).eval()
    x = torch.randn(256, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        graph = capture(model, x)

    def forwards(stop: threading.Event, count: list[int], own_stream: bool = True) -> None:
        """Replays on a stream of the forward's own (as the service runs it), or on the legacy default stream,
        whose work waits for every blocking stream's."""
        stream = torch.cuda.Stream() if own_stream else torch.cuda.default_stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                graph.replay()
                stream.synchronize()
                count[0] += 256

    def decodes(decoder: Any, stop: threading.Event, count: list[int], priority: int = 0, reuse: bool = False) -> None:
        """Batches of 256 on a stream of `priority`; with `reuse`, into the previous batch's images."""
        stream = torch.cuda.Stream(priority=priority)
        i, out = 0, None
        while not stop.is_set():
            chunk = [streams[(i + k) % images] for k in range(256)]
            out = decoder.decode(chunk, images=out if reuse else None, params=params, cuda_stream=stream.cuda_stream)
            stream.synchronize()
            count[0] += 256
            i += 256

    together = functools.partial(loops_together, seconds=seconds)

    result["beside_forward"] = {"forward_alone_img_per_s": together([forwards])[0]}
    on_default = functools.partial(forwards, own_stream=False)
    # (label, decoder, the forward's loop, decoding stream priority, output images reused)
    runs: list[tuple[str, str, Callable[[threading.Event, list[int]], None], int, bool]] = [
        ("hardware", "hardware", forwards, 0, False),
        ("cuda", "cuda", forwards, 0, False),
        ("adaptive", "adaptive", forwards, 0, False),
        ("split-0.5", "split-0.5", forwards, 0, False),
        ("split-0.75", "split-0.75", forwards, 0, False),
        ("split-0.9", "split-0.9", forwards, 0, False),
        ("hardware, forward on the default stream", "hardware", on_default, 0, False),
        ("cuda, forward on the default stream", "cuda", on_default, 0, False),
        ("hardware, decoding stream first", "hardware", forwards, -1, False),
        ("hardware, images reused", "hardware", forwards, 0, True),
        ("hardware, preallocated", "hardware-preallocated", forwards, 0, False),
        ("hardware, preallocated, 4 threads", "hardware-preallocated-4", forwards, 0, False),
        ("hardware, preallocated, 4 threads, first, reused", "hardware-preallocated-4", forwards, -1, True),
        ("VIT_DECODE=nvimgcodec's decoder", "service", forwards, 0, False),
    ]
    for name, decoder, forward, priority, reuse in runs:
        try:
            dec = functools.partial(decodes, decoders[decoder], priority=priority, reuse=reuse)
            forward_rate, decode_rate = together([forward, dec])
            result["beside_forward"][name] = {"forward_img_per_s": forward_rate, "decode_img_per_s": decode_rate}
        except Exception as e:
            result["beside_forward"][name] = {"error": repr(e)}
        print("hwdecode: beside forward", name, json.dumps(result["beside_forward"].get(name)), flush=True)

    # Pixels: the hardware engines' against torchvision's nvJPEG (uint8 RGB), then after the service's transform
    # against the CPU path (normalised units, as the decode part reports for nvJPEG).
    cuda = torch.device("cuda")
    tv = GpuJpegDecoder(VIT_S16_PREPROCESSING, cuda, lambda j: torch.zeros(()), TorchvisionJpeg(cuda))
    cpu = Preprocessor(VIT_S16_PREPROCESSING)
    pixels: dict[str, Any] = {}
    reference = tv.decode(files[:64])
    for name in ("hardware", "cuda"):
        try:
            out = decoders[name].decode(streams[:64], params=params)
            got = [torch.as_tensor(o, device="cuda").permute(2, 0, 1) for o in out if o is not None]
            diffs = [(g.int() - r.int()).abs() for g, r in zip(got, reference, strict=False) if r is not None]
            normalised = tv.transform(torch.stack(got))
            want = torch.stack([cpu(decode_image(f, "x.jpg", 3, 10**8)) for f in files[:64]]).cuda()
            pixels[name] = {
                "decoded": len(got),
                "uint8_vs_nvjpeg_max": int(max(d.max() for d in diffs)),
                "uint8_vs_nvjpeg_mean": float(torch.stack([d.float().mean() for d in diffs]).mean()),
                "normalised_vs_cpu_max": float((normalised - want).abs().max()),
                "normalised_vs_cpu_mean": float((normalised - want).abs().mean()),
            }
        except Exception as e:
            pixels[name] = {"error": repr(e)}
    result["pixels"] = pixels

    # Which JPEGs the hardware engines take (None: left to the next backend).
    kinds: dict[str, bytes] = {}
    photo = Image.open(io.BytesIO(files[0])).convert("RGB")
    encodings: dict[str, dict[str, Any]] = {
        "baseline 4:2:0": {"subsampling": 2},
        "baseline 4:2:2": {"subsampling": 1},
        "baseline 4:4:4": {"subsampling": 0},
        "progressive": {"progressive": True},
        "grayscale": {},
    }
    for kind, options in encodings.items():
        buffer = io.BytesIO()
        (photo.convert("L") if kind == "grayscale" else photo).save(buffer, format="JPEG", quality=90, **options)
        kinds[kind] = buffer.getvalue()
    takes: dict[str, Any] = {}
    for kind, data in kinds.items():
        try:
            takes[kind] = {
                name: decoders[name].decode(nv.CodeStream(data), params=params) is not None
                for name in ("hardware", "split-0.75")
            }
        except Exception as e:
            takes[kind] = {"error": repr(e)}
    result["hardware_takes"] = takes
    print("hwdecode:", json.dumps({k: v for k, v in result.items() if k != "alone"}), flush=True)
    return result
