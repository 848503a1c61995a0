"""Read a state dict from .safetensors, .pth or .bin without unpickling arbitrary objects."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from model.convert.converted import ConversionError

WRAPPER_KEYS = ("state_dict", "model", "module", "state_dict_ema", "model_ema")


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """Tensors of a weights file; training checkpoints that wrap the state dict are unwrapped."""
    if not path.is_file():
        raise ConversionError(f"{path}: file not found")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"{path}: not a readable safetensors file ({e})") from e
    try:
        # weights_only: tensors and plain containers only; a pickled object is refused, never run
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0]
        raise ConversionError(
            f"{path}: not a plain state dict; torch.load(weights_only=True) refused it ({first})"
        ) from e
    except (RuntimeError, OSError, EOFError) as e:
        raise ConversionError(f"{path}: not a readable PyTorch file ({e})") from e
    return unwrap(path, loaded)


def unwrap(path: Path, loaded: object) -> dict[str, Tensor]:
    if isinstance(loaded, dict):
        for key in WRAPPER_KEYS:  # {"state_dict": {...}, "epoch": 3, ...} as training scripts save
            if isinstance(loaded.get(key), dict):
                loaded = loaded[key]
                break
    if not isinstance(loaded, dict) or not loaded:
        raise ConversionError(f"{path}: expected a dict of tensors (a state dict), got {type(loaded).__name__}")
    tensors: dict[str, Tensor] = {}
    for name, value in loaded.items():
        if not isinstance(value, Tensor):
            raise ConversionError(f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor")
        tensors[str(name).removeprefix("module.")] = value  # DistributedDataParallel's prefix
    return tensors
