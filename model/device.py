"""The one place a device name ("auto", "cpu", "cuda", "cuda:N") becomes a torch.device."""

from __future__ import annotations

import re
from pathlib import Path

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


NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")  # present wherever the NVIDIA kernel driver is loaded
# The oldest driver each CUDA major version's runtime runs on (NVIDIA's CUDA compatibility table).
MIN_DRIVER = {11: 450, 12: 525, 13: 580}


def nvidia_driver_version(path: Path = NVIDIA_DRIVER) -> str | None:
    """The loaded NVIDIA kernel driver's version ("570.86.15"), or None where there is none."""
    try:
        text = path.read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else None


def cuda_unavailable_reason(path: Path = NVIDIA_DRIVER, cuda: str | None = None) -> str | None:
    """Why an NVIDIA driver is present but CUDA cannot be used; None when CUDA works or there is no driver."""
    if torch.cuda.is_available():
        return None
    driver = nvidia_driver_version(path)
    if driver is None:
        return None
    cuda = cuda if cuda is not None else torch.version.cuda
    if cuda is None:
        return f"NVIDIA driver {driver} found, but this torch build has no CUDA support; install a CUDA build of torch"
    floor = MIN_DRIVER.get(int(cuda.split(".")[0]))
    if floor is not None and int(driver.split(".")[0]) < floor:
        return f"NVIDIA driver {driver} found, but this torch build (CUDA {cuda}) needs driver >= {floor}; upgrade the driver"
    return f"NVIDIA driver {driver} found, but torch (CUDA {cuda}) sees no usable GPU; check the container's GPU access"
