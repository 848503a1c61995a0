"""An Open Inference Protocol input tensor's elements, wherever they travel (JSON `data`, the binary extension, gRPC's
contents): encoded image files (BYTES `image`), or preprocessed pixels (FP32 `pixels`), checked against the
tensor's shape and the request's limits."""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.choices import Datatype
from app.codecs.v2_schemas import IMAGE, PIXELS, TensorIn
from app.core.contract.errors import InvalidInput
from app.core.contract.request import EncodedImage


@dataclass(frozen=True)
class TensorData:
    """Where the input's elements are when not in its JSON `data`: raw little-endian bytes (the binary
    extension, gRPC's raw_input_contents), gRPC BYTES `contents`, or gRPC FP32 `contents`."""

    raw: bytes | None = None
    elements: list[bytes] | None = None
    values: np.ndarray | None = None


def binary_chunk(tensor: TensorIn, binary: bytes) -> bytes | None:
    """The input's bytes from the binary part, or None when its data is in the JSON."""
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is None:
        if binary:
            raise InvalidInput(f"{len(binary)} bytes of binary data follow the JSON, but no input has binary_data_size")
        return None
    if not isinstance(size, int) or size != len(binary):
        raise InvalidInput(
            f"input {tensor.name!r}: binary_data_size {size!r} does not match the {len(binary)} bytes after the JSON header"
        )
    return binary


def batch_size(tensor: TensorIn, max_images: int) -> int:
    n = tensor.shape[0] if tensor.shape else 0
    if n < 1:
        raise InvalidInput(f"input {tensor.name!r}: shape {tensor.shape} has no images")
    if n > max_images:
        raise InvalidInput(f"input {tensor.name!r}: {n} images in one request; at most {max_images} are accepted")
    return n


def decode_images(tensor: TensorIn, data: TensorData, max_images: int) -> list[EncodedImage]:
    if tensor.datatype != Datatype.BYTES:
        raise InvalidInput(f"input {IMAGE!r} must be BYTES (encoded image files), got {tensor.datatype}")
    if len(tensor.shape) not in (1, 2) or (len(tensor.shape) == 2 and tensor.shape[1] != 1):
        raise InvalidInput(f"input {IMAGE!r} must have shape [N] or [N, 1], got {tensor.shape}")
    n = batch_size(tensor, max_images)
    if data.raw is not None:
        files = split_bytes_elements(data.raw)
    elif data.elements is not None:
        files = data.elements
    else:
        files = json_bytes_elements(tensor.data)
    if len(files) != n:
        raise InvalidInput(f"input {IMAGE!r}: shape {tensor.shape} says {n} images, the data holds {len(files)}")
    return [EncodedImage(f"{IMAGE}[{i}]", data) for i, data in enumerate(files)]


def split_bytes_elements(buf: bytes) -> list[bytes]:
    """The binary extension's BYTES layout: each element a 4-byte little-endian length, then its bytes."""
    out: list[bytes] = []
    i = 0
    while i < len(buf):
        if i + 4 > len(buf):
            raise InvalidInput(f"binary BYTES data ends inside the length prefix of element {len(out)}")
        size = int.from_bytes(buf[i : i + 4], "little")
        i += 4
        if i + size > len(buf):
            raise InvalidInput(f"binary BYTES element {len(out)} claims {size} bytes, only {len(buf) - i} remain")
        out.append(buf[i : i + size])
        i += size
    return out


def json_bytes_elements(data: Any) -> list[bytes]:
    if data is None:
        raise InvalidInput(f"input {IMAGE!r} has no data: send it in 'data' (base64) or as binary_data_size bytes")
    out = []
    for i, element in enumerate(flatten(data)):
        if not isinstance(element, str):
            raise InvalidInput(
                f"input {IMAGE!r}: element {i} must be a base64 string in JSON, got {type(element).__name__}"
            )
        try:
            out.append(base64.b64decode(element, validate=True))
        except (binascii.Error, ValueError):
            raise InvalidInput(
                f"input {IMAGE!r}: element {i} is not base64; in JSON send base64 of the file, "
                "or send raw bytes with the binary extension"
            ) from None
    return out


def decode_pixels(
    tensor: TensorIn, data: TensorData, input_shape: tuple[int, int, int], max_images: int
) -> torch.Tensor:
    if tensor.datatype != Datatype.FP32:
        raise InvalidInput(f"input {PIXELS!r} must be FP32, got {tensor.datatype}")
    expected = [-1, *input_shape]
    if len(tensor.shape) != 4 or list(tensor.shape[1:]) != list(input_shape):
        raise InvalidInput(f"input {PIXELS!r} must have shape {expected} for this model, got {tensor.shape}")
    n = batch_size(tensor, max_images)
    count = n * math.prod(input_shape)
    if data.raw is not None:
        if len(data.raw) != count * 4:
            raise InvalidInput(
                f"input {PIXELS!r}: shape {tensor.shape} needs {count * 4} bytes of FP32, got {len(data.raw)}"
            )
        array = np.frombuffer(data.raw, dtype="<f4")
    elif data.values is not None:
        array = data.values
        if array.size != count:
            raise InvalidInput(
                f"input {PIXELS!r}: shape {tensor.shape} needs {count} values, the data holds {array.size}"
            )
    else:
        try:
            array = np.asarray(flatten(tensor.data), dtype=np.float32)
        except (TypeError, ValueError):
            raise InvalidInput(f"input {PIXELS!r}: data must be numbers") from None
        if array.size != count:
            raise InvalidInput(
                f"input {PIXELS!r}: shape {tensor.shape} needs {count} values, the data holds {array.size}"
            )
    if not np.isfinite(array).all():
        raise InvalidInput(f"input {PIXELS!r} contains NaN or infinite values")
    return torch.from_numpy(array.astype(np.float32).reshape(n, *input_shape))


def flatten(data: Any) -> list[Any]:
    """Row-major elements of JSON tensor data, flat or nested."""
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    for item in data:
        out.extend(flatten(item) if isinstance(item, list) else [item])
    return out
