"""JPEG bytes to probabilities on the host, with no serving: the service's own predictor fed whole batches of
JPEGs, for each GPU decoder, one batch at a time and two in flight (as the batcher keeps them). The ceiling the
JPEG routes are held to, beside the forward alone (`raw`)."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from app.choices import DecodeChoice
from app.core.backends.predictor import ImageInput, Predictor
from app.core.images.gpu_decode import GpuJpegDecoder, Jpeg, jpeg_decoder_for
from harness.images import photo_jpeg
from model.checkpoint import load_checkpoint

# the decoders `VIT_DECODE` names, by what they are
DECODERS: dict[str, DecodeChoice] = {"nvJPEG (torchvision)": "auto", "nvImageCodec (JPEG engines first)": "nvimgcodec"}


def refuse(jpeg: Jpeg) -> torch.Tensor:
    raise RuntimeError(f"{jpeg.filename}: the GPU decoder refused a plain JPEG")


def rate(predictor: Predictor, batches: list[list[ImageInput]], in_flight: int, seconds: float) -> float:
    """Images per second through `predictor` from `in_flight` threads, each taking the next batch in turn."""
    done, turn, lock = [0] * in_flight, iter(range(10**9)), threading.Lock()
    stop = time.monotonic() + seconds

    def worker(k: int) -> None:
        while time.monotonic() < stop:
            with lock:
                batch = batches[next(turn) % len(batches)]
            predictor(batch)
            done[k] += len(batch)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(in_flight)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.monotonic() - started)


def pipeline(
    checkpoints: dict[str, Path],
    device: torch.device,
    images: int = 1024,
    batch: int = 256,
    seconds: float = 3.0,
) -> dict[str, Any]:
    """For each model and decoder: img/s with one batch in flight and with two, and what it ran."""
    files = [photo_jpeg(i) for i in range(images)]
    result: dict[str, Any] = {"image": "500x375 JPEG, quality 90", "batch": batch, "device": str(device)}
    for name, path in checkpoints.items():
        ckpt = load_checkpoint(path, device)
        result[name] = {}
        for label, choice in DECODERS.items():
            try:
                jpegs = GpuJpegDecoder(ckpt.preprocessing, device, refuse, jpeg_decoder_for(choice, device))
                graphs = [batch] if device.type == "cuda" else None
                predictor = Predictor(ckpt, device, "torch", jpegs, graphs)
                batches = [
                    [ImageInput(Jpeg(f, f"{k + i}.jpg"), "none") for i, f in enumerate(files[k : k + batch])]
                    for k in range(0, images, batch)
                ]
                predictor(batches[0])  # the decoder's and the graphs' first call
                result[name][label] = {
                    "decoder": jpegs.decode.name,
                    "one_in_flight_img_per_s": rate(predictor, batches, 1, seconds),
                    "two_in_flight_img_per_s": rate(predictor, batches, 2, seconds),
                }
            except Exception as e:  # a decoder this machine lacks: say so, measure the others
                result[name][label] = {"error": repr(e)}
            print(f"pipeline {name} {label}: {result[name][label]}", flush=True)
    return result


def pipeline_part(models: list[str], images: int = 1024, batch: int = 256) -> dict[str, Any]:
    """The part `raw` adds on the GPU: random-weight checkpoints of the benchmark's models."""
    from bench.gpu.serving import random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {name: random_checkpoint(Path(tmp), name) for name in models}
        return pipeline(checkpoints, torch.device("cuda"), images, batch)
