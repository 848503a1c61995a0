"""Preprocessing 500x375 JPEGs: PIL on CPU threads against nvJPEG and the resize on the GPU."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bench.common import photo_jpeg
from harness.models import VIT_S16_PREPROCESSING


def decode(images: int = 512, batch: int = 64) -> dict[str, Any]:
    from app.core.images.decode import decode_image
    from app.core.images.gpu_decode import GpuJpegDecoder, Jpeg
    from app.core.images.prepare import Preprocessor

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
