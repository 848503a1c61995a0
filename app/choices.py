"""The service's closed choices, each defined once.

Settings, argparse choices, the codecs and the docs derive from these; nothing else spells them.
This module imports nothing heavy, so settings and command lines can use it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args

Backend = Literal["torch", "onnxruntime", "onnxruntime-int8"]  # what computes probabilities
BackendChoice = Literal["auto", Backend]  # auto: onnxruntime on the CPU, torch on a GPU
BACKENDS: tuple[Backend, ...] = get_args(Backend)
ONNX_BACKENDS: tuple[Backend, ...] = ("onnxruntime", "onnxruntime-int8")

Precision = Literal["float32", "bfloat16", "float16", "int8"]  # the arithmetic of plain predictions
Quantization = Literal["dynamic", "static"]  # how an int8 graph was made
# VIT_DECODE: auto decodes plain JPEGs on a GPU (nvJPEG); nvimgcodec and dali: its JPEG engines, then the CUDA
# decoder (through nvImageCodec, or DALI's mixed decoder)
DecodeChoice = Literal["auto", "nvimgcodec", "dali", "cpu"]
# VIT_V2_OUTPUTS: the outputs V2 lists and answers: all of them, or probabilities alone (a plain classification)
V2OutputsChoice = Literal["all", "probabilities"]
DecodedOn = Literal["cpu", "gpu"]  # where a model's plain JPEGs are decoded
ModelControl = Literal["none", "explicit", "poll"]  # how the model repository may change
ModelState = Literal["READY", "UNAVAILABLE", "LOADING", "UNLOADING"]  # a model's line in the repository index
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]  # VIT_LOG_FORMAT


class Datatype(StrEnum):
    """The Open Inference Protocol tensor datatypes this service reads and writes."""

    BYTES = "BYTES"  # length-prefixed byte strings: encoded images in, classification strings out
    FP32 = "FP32"  # little-endian float32: pixels in, probabilities, maps and embeddings out


def choices(literal: object) -> tuple[str, ...]:
    """The values of a `Literal` (nested ones flattened), for argparse and messages."""
    out: list[str] = []
    for arg in get_args(literal):
        out.extend(choices(arg) if get_args(arg) else [arg])
    return tuple(out)
