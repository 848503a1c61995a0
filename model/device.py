"""The one place a device name ("auto", "cpu", "cuda", "cuda:N") becomes a torch.device."""

from __future__ import annotations

import torch


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """'auto' picks a GPU when there is one, else the CPU; explicit names are checked.

    `local_rank` (a torchrun process) turns a bare "cuda" into that process's own GPU.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and local_rank is not None:
        name = f"cuda:{local_rank}"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name} asked for, but no CUDA device is available; use auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name} asked for, but only {torch.cuda.device_count()} CUDA devices exist")
    return device
