"""The models, parts and variants of the GPU benchmark, and its timer."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harness.models import VIT_S16
from model.vit import ViTConfig

VIT_B16 = ViTConfig(image_size=224, patch_size=16, dim=768, depth=12, heads=12, num_classes=1000, norm_eps=1e-6)
MODELS = {"vit-s16": VIT_S16, "vit-b16": VIT_B16}
PARTS = ("tests", "smoke", "ceilings", "raw", "decode", "hwdecode", "engines", "served", "profile")
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# What each served variant sets beyond the common settings (VIT_DEVICE=auto, batch size, wait, queue).
VARIANTS: dict[str, dict[str, str]] = {
    # one serving process
    "cpu-decode": {"VIT_DECODE": "cpu", "VIT_CUDA_GRAPHS": "false", "VIT_WORKERS": "1"},  # before either change
    "gpu-decode": {"VIT_DECODE": "auto", "VIT_CUDA_GRAPHS": "false", "VIT_WORKERS": "1"},
    "gpu-decode+graphs": {"VIT_DECODE": "auto", "VIT_CUDA_GRAPHS": "true", "VIT_WORKERS": "1"},
    # front-end processes over one engine process, the rest as the defaults: what VIT_WORKERS=auto should pick
    "workers-2": {"VIT_DECODE": "auto", "VIT_CUDA_GRAPHS": "true", "VIT_WORKERS": "2"},
    "workers-4": {"VIT_DECODE": "auto", "VIT_CUDA_GRAPHS": "true", "VIT_WORKERS": "4"},
    "workers-8": {"VIT_DECODE": "auto", "VIT_CUDA_GRAPHS": "true", "VIT_WORKERS": "8"},
    "workers-12": {"VIT_DECODE": "auto", "VIT_CUDA_GRAPHS": "true", "VIT_WORKERS": "12"},
    # nvImageCodec: the GPU's hardware JPEG engines, then its CUDA decoder, instead of nvJPEG
    "workers-8-nvimgcodec": {"VIT_DECODE": "nvimgcodec", "VIT_CUDA_GRAPHS": "true", "VIT_WORKERS": "8"},
    # the same, half of each batch to the engines and half to the CUDA decoder (VIT_HW_DECODER_LOAD)
    "workers-8-nvimgcodec-0.5": {
        "VIT_DECODE": "nvimgcodec",
        "VIT_HW_DECODER_LOAD": "0.5",
        "VIT_CUDA_GRAPHS": "true",
        "VIT_WORKERS": "8",
    },
    # DALI's mixed decoder (VIT_DECODE=dali; carried as parts, see bench/gpu.sh), all to the engines, and 0.65
    "workers-8-dali": {"VIT_DECODE": "dali", "VIT_CUDA_GRAPHS": "true", "VIT_WORKERS": "8"},
    "workers-8-dali-0.65": {
        "VIT_DECODE": "dali",
        "VIT_HW_DECODER_LOAD": "0.65",
        "VIT_CUDA_GRAPHS": "true",
        "VIT_WORKERS": "8",
    },
    # the share of plain JPEGs the front-ends' cores decode, the rest by nvJPEG: fixed, then found (auto)
    **{
        f"workers-8-share-{share}": {
            "VIT_DECODE": "auto",
            "VIT_CPU_DECODE_SHARE": share,
            "VIT_CUDA_GRAPHS": "true",
            "VIT_WORKERS": "8",
        }
        for share in ("0", "0.3", "0.5", "0.7", "auto")
    },
    # every image decoded by PIL on the front-ends' cores instead of on the GPU: what the CPUs add
    "workers-8-cpu-decode": {"VIT_DECODE": "cpu", "VIT_CUDA_GRAPHS": "true", "VIT_WORKERS": "8"},
}


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


def save(out: Path, part: str, result: dict[str, Any]) -> None:
    """One part's results as DIR/<part>.json, written as soon as the part finishes."""
    (out / f"{part}.json").write_text(json.dumps(result, indent=2))
