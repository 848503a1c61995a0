"""The forward step: the only code that touches the device, run on the batcher's worker thread."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from model.checkpoint import Checkpoint
from model.rollout import attention_map

log = logging.getLogger("app.inference")


@dataclass(frozen=True)
class ImageInput:
    pixels: Tensor  # (C, S, S) float32, normalised
    attention: str  # "none", "rollout" or "last"


@dataclass(frozen=True)
class ImageOutput:
    probabilities: Tensor  # (num_classes,) float32 on the CPU
    attention_map: Tensor | None  # (grid, grid) in [0, 1], when asked for


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to and including the maximum: the sizes the batcher will produce most."""
    return sorted({min(2**k, max_batch_size) for k in range(max_batch_size.bit_length() + 1)})


def inference_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, fp16 on older ones, fp32 on the CPU."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class Predictor:
    """Runs batches through the checkpoint's model: probabilities for all, attention maps for those asking."""

    def __init__(self, checkpoint: Checkpoint, device: torch.device) -> None:
        self.device = device
        self.dtype = inference_dtype(device)
        self.model = checkpoint.model.to(device=device, dtype=self.dtype).eval()
        config = checkpoint.config
        self.input_shape = (config.in_channels, config.image_size, config.image_size)

    def __call__(self, batch: list[ImageInput]) -> list[ImageOutput]:
        try:
            return self.forward(batch)
        except torch.OutOfMemoryError:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # give the batcher's smaller retries the memory back
            raise

    @torch.inference_mode()
    def forward(self, batch: list[ImageInput]) -> list[ImageOutput]:
        x = torch.stack([item.pixels for item in batch])
        x = x.pin_memory() if self.device.type == "cuda" else x
        x = x.to(self.device, self.dtype, non_blocking=True)  # (B, C, S, S)
        wanted = [i for i, item in enumerate(batch) if item.attention != "none"]
        maps: dict[int, Tensor] = {}
        if wanted:  # one pass on the explicit path serves plain and attention requests alike
            logits, attentions = self.model.forward_with_attention(x)
            for method in {batch[i].attention for i in wanted}:
                idx = [i for i in wanted if batch[i].attention == method]
                rows = torch.tensor(idx, device=self.device)
                found = attention_map([a[rows] for a in attentions], method, self.model.readout)
                for i, m in zip(idx, found.float().cpu(), strict=True):
                    maps[i] = m
        else:
            logits = self.model(x)
        probabilities = logits.float().softmax(dim=-1).cpu()  # (B, num_classes)
        return [ImageOutput(probabilities[i], maps.get(i)) for i in range(len(batch))]

    def warm_up(self, max_batch_size: int) -> float:
        """Run every power-of-two batch size up to the maximum (and the maximum), both paths; returns seconds."""
        started = time.perf_counter()
        sizes = batch_sizes(max_batch_size)
        blank = torch.zeros(self.input_shape)
        for size in sizes:
            self([ImageInput(blank, "none")] * size)
        self([ImageInput(blank, "rollout"), ImageInput(blank, "last")])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        log.info("warmed up batch sizes %s in %.2fs", sizes, seconds)
        return seconds
