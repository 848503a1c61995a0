"""The Open Inference Protocol (KServe V2): request parsing, no HTTP (its bodies: `app.codecs.v2_schemas`; its
tensors' elements: `app.codecs.v2_tensors`; its answers: `app.codecs.v2_responses`).

Inputs (one per request): `image`, BYTES [N] or [N, 1], encoded image files decoded and preprocessed
exactly as /predict does; or `pixels`, FP32 [N, C, H, W], already preprocessed. Outputs:
`probabilities`, FP32 [N, classes], and `attention`, FP32 [N, grid, grid], when the request parameter
`attention` names a map (`rollout`, `last`, or `gradient` for the class in the parameter `target`,
default each image's top-1); and `embedding`, FP32 [N, D], the pooled representation the head
receives, when the output is asked for or the parameter `embedding` is true (`normalize`: L2-normalised);
and `ood_score`, FP32 [N], each image's distance from the model's reference data, when the parameter `ood` is
true. A zero-shot model (CLIP, SigLIP) takes the parameters `labels` (its classes for this request) and
`template`, and answers `probabilities` as FP32 [N, labels]; it also takes the input `text`, BYTES [T] of UTF-8
strings, in a request of its own, answered with `text_embedding`, FP32 [T, D], each text's unit-length embedding
in the space the images' `embedding` shares (`normalize`: unit length too). A model with heads taught by example
takes the parameter `head`, and answers `probabilities` as FP32 [N, the head's classes].
Extensions: binary tensor data (`Inference-Header-Content-Length`,
`binary_data_size`; BYTES elements as 4-byte little-endian length + bytes), classification
(`classification: k` on an output: BYTES [N, k] of Triton's "score:index:label"), and system shared
memory (`shared_memory_region`, `shared_memory_byte_size` and `shared_memory_offset` on an input, whose
bytes are then read from that region in the binary layout, or on an output, which is then written there).
In JSON, a BYTES element of `image` is the base64 of the file (raw image bytes are not valid JSON text).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from app.choices import Datatype
from app.codecs.v2_metadata import every_output, listed_outputs
from app.codecs.v2_schemas import (
    ATTENTION,
    DEFAULT_MAP,
    EMBEDDING,
    IMAGE,
    IMAGE_OUTPUTS,
    OOD_SCORE,
    OUTPUT_NAMES,
    OUTPUT_PARAMETERS,
    PIXELS,
    PROBABILITIES,
    SHM_BYTE_SIZE,
    SHM_OFFSET,
    SHM_REGION,
    TEXT,
    TEXT_EMBEDDING,
    InferRequest,
    TensorIn,
)
from app.codecs.v2_tensors import (
    TensorData,
    binary_chunk,
    decode_images,
    decode_pixels,
    flatten,
    split_bytes_elements,
)
from app.core.contract.description import ModelDescription
from app.core.contract.errors import InvalidInput, validation_problems
from app.core.contract.inference import Limits
from app.core.contract.regions import SharedMemoryRegions
from app.core.contract.request import (
    ATTENTION_KINDS,
    AttentionKind,
    EncodedImage,
    InferOptions,
    parse_labels,
)


@dataclass(frozen=True)
class Decoded:
    """A parsed request: the core's inputs (files to decode, or preprocessed pixels) and options, and what to send
    back, with the shared-memory regions any output is written to."""

    request: InferRequest
    options: InferOptions
    inputs: list[EncodedImage] | torch.Tensor
    regions: SharedMemoryRegions | None = None
    texts: tuple[str, ...] | None = None  # a zero-shot model's texts to embed (`inputs` then empty)


@dataclass(frozen=True)
class Intake:
    """What decoding a request is checked against: the model's input shape (C, H, W), the most images and
    bytes a request may bring, and the shared-memory regions its tensors may point into."""

    input_shape: tuple[int, int, int]
    max_images: int
    max_bytes: int
    regions: SharedMemoryRegions
    takes_pixels: bool = True
    outputs: tuple[str, ...] = IMAGE_OUTPUTS  # what the model's metadata lists (`listed_outputs`)
    takes_text: bool = False  # a zero-shot model: the input `text`


def intake_for(model: ModelDescription, limits: Limits, regions: SharedMemoryRegions) -> Intake:
    """What a request to this model is checked against, under the edge's limits."""
    outputs = listed_outputs(model, limits.all_outputs)
    zero_shot = model.zero_shot is not None
    return Intake(
        model.input_shape, limits.max_files, limits.max_upload_bytes, regions, limits.takes_pixels, outputs, zero_shot
    )


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(JSON part, binary part) per the binary extension's Inference-Header-Content-Length."""
    if header_length is None:
        return body, b""
    if not header_length.isdigit() or int(header_length) > len(body):
        raise InvalidInput(
            f"Inference-Header-Content-Length {header_length!r} must be the byte length of the JSON header, "
            f"at most the body's {len(body)} bytes"
        )
    n = int(header_length)
    return body[:n], body[n:]


def parse_request(header: bytes) -> InferRequest:
    try:
        return InferRequest.model_validate(json.loads(header))
    except (ValueError, UnicodeDecodeError) as e:  # json errors are ValueErrors
        if isinstance(e, ValidationError):
            raise InvalidInput(f"invalid inference request: {validation_problems(e.errors())}") from None
        raise InvalidInput(f"the inference request is not valid JSON ({e})") from None


def decode_request(header: bytes, binary: bytes, intake: Intake) -> Decoded:
    """Check and decode one REST infer request (JSON, then any binary data)."""
    request = parse_request(header)
    return decode_infer(request, lambda tensor: TensorData(raw=binary_chunk(tensor, binary)), intake)


def check_one_input(request: InferRequest) -> None:
    if len(request.inputs) != 1:
        raise InvalidInput(f"send exactly one input, {IMAGE!r} (BYTES) or {PIXELS!r} (FP32); got {len(request.inputs)}")


def decode_infer(request: InferRequest, data_of: Callable[[TensorIn], TensorData], intake: Intake) -> Decoded:
    """A parsed infer request, from any transport, checked and decoded into the core's inputs and options;
    `data_of` finds the input's elements outside its JSON `data` (and outside shared memory), once the request
    itself is checked."""
    check_outputs(request, intake)  # before any compute is spent
    named = {output.name for output in request.outputs or []}
    if len(request.inputs) == 1 and request.inputs[0].name == TEXT and intake.takes_text:
        return decode_texts(request, named, data_of, intake)
    if TEXT_EMBEDDING in named:
        raise InvalidInput(f"output {TEXT_EMBEDDING!r} answers a request whose input is {TEXT!r}: send the texts alone")
    attention = request_attention(request)
    options = InferOptions(
        # an output named is computed, with its defaults where no parameter chooses: a rollout map
        DEFAULT_MAP if attention == "none" and ATTENTION in named else attention,
        request_target(request),
        embedding=request_flag(request, EMBEDDING) or EMBEDDING in named,
        normalize=request_flag(request, "normalize"),
        ood=request_flag(request, "ood") or OOD_SCORE in named,
        labels=request_labels(request),
        template=request_string(request, "template"),
        classify=not named or PROBABILITIES in named,
        head=request_string(request, "head"),
    )
    check_listed(options, intake)
    check_one_input(request)
    tensor = request.inputs[0]
    if tensor.name not in ((IMAGE, PIXELS) if intake.takes_pixels else (IMAGE,)):
        pixels = f"FP32 [N, {', '.join(map(str, intake.input_shape))}], preprocessed"
        takes = f"{IMAGE!r} (BYTES [N], encoded image files) or {PIXELS!r} ({pixels})"
        if not intake.takes_pixels:
            takes = f"only {IMAGE!r} (BYTES [N], encoded image files): this server takes no pixels (VIT_V2_PIXELS)"
        raise InvalidInput(f"unknown input {tensor.name!r}; this model takes {takes}")
    params = tensor.parameters or {}
    if SHM_REGION in params:
        if tensor.data is not None or "binary_data_size" in params:
            raise InvalidInput(f"input {tensor.name!r} is in shared memory ({SHM_REGION}): send no data with it")
        what = f"input {tensor.name!r}"
        if SHM_BYTE_SIZE not in params:
            raise InvalidInput(f"{what}: {SHM_REGION} needs {SHM_BYTE_SIZE}, the byte count to read")
        raw = intake.regions.read(
            params[SHM_REGION], params.get(SHM_OFFSET, 0), params[SHM_BYTE_SIZE], what, intake.max_bytes
        )
        data = TensorData(raw=raw)
    else:
        data = data_of(tensor)
    if tensor.name == IMAGE:
        return Decoded(request, options, decode_images(tensor, data, intake.max_images), intake.regions)
    return Decoded(request, options, decode_pixels(tensor, data, intake.input_shape, intake.max_images), intake.regions)


def decode_texts(
    request: InferRequest, named: set[str], data_of: Callable[[TensorIn], TensorData], intake: Intake
) -> Decoded:
    """A zero-shot model's request of texts to embed: BYTES [T] (or [T, 1]) of UTF-8, answered with text_embedding."""
    if TEXT_EMBEDDING not in intake.outputs:
        raise InvalidInput(
            f"input {TEXT!r} asks for {TEXT_EMBEDDING!r}, an output this server does not give: it serves "
            f"{', '.join(map(repr, intake.outputs))} alone (VIT_V2_OUTPUTS=probabilities)"
        )
    if other := named - {TEXT_EMBEDDING}:
        raise InvalidInput(
            f"a request whose input is {TEXT!r} answers {TEXT_EMBEDDING!r} alone; output {sorted(other)[0]!r} "
            f"answers images: send them in a request of their own"
        )
    tensor = request.inputs[0]
    if SHM_REGION in (tensor.parameters or {}):
        raise InvalidInput(f"input {TEXT!r} is read from the request, not from shared memory")
    if tensor.datatype != Datatype.BYTES:
        raise InvalidInput(f"input {TEXT!r} must be BYTES (UTF-8 strings), got {tensor.datatype}")
    if len(tensor.shape) not in (1, 2) or (len(tensor.shape) == 2 and tensor.shape[1] != 1):
        raise InvalidInput(f"input {TEXT!r} must have shape [T] or [T, 1], got {tensor.shape}")
    n = tensor.shape[0]
    data = data_of(tensor)
    if data.raw is not None:
        elements = split_bytes_elements(data.raw)
    elif data.elements is not None:
        elements = data.elements
    else:  # JSON: the strings themselves
        values = flatten(tensor.data) if tensor.data is not None else []
        if not all(isinstance(v, str) for v in values):
            raise InvalidInput(f"input {TEXT!r}: each element must be a string in JSON")
        elements = [v.encode() for v in values]
    if len(elements) != n:
        raise InvalidInput(f"input {TEXT!r}: shape {tensor.shape} says {n} texts, the data holds {len(elements)}")
    try:
        texts = tuple(e.decode("utf-8") for e in elements)
    except UnicodeDecodeError as e:
        raise InvalidInput(f"input {TEXT!r}: an element is not UTF-8 ({e})") from None
    return Decoded(request, InferOptions(classify=False), [], intake.regions, texts)


def request_attention(request: InferRequest) -> AttentionKind:
    attention = (request.parameters or {}).get("attention", "none")
    if attention not in ATTENTION_KINDS:
        raise InvalidInput(
            f"request parameter attention must be one of {', '.join(ATTENTION_KINDS)}; got {attention!r}"
        )
    kind: AttentionKind = attention
    return kind


def request_target(request: InferRequest) -> str | None:
    target = (request.parameters or {}).get("target")
    if target is None:
        return None
    if isinstance(target, bool) or not isinstance(target, str | int):
        raise InvalidInput(f"the parameter target must be a class label or index, got {target!r}")
    return str(target)


def request_labels(request: InferRequest) -> tuple[str, ...] | None:
    """A zero-shot request's labels: the parameter `labels` as a string, comma-separated, or a JSON array of
    strings (in a string over gRPC, whose parameters are scalars: labels that hold commas)."""
    value = (request.parameters or {}).get("labels")
    if value is None:
        return None
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidInput(
                f"the parameter labels starts with [ but is not a JSON array of strings: {value!r}"
            ) from None
    if isinstance(value, list):
        if not all(isinstance(label, str) for label in value):
            raise InvalidInput(f"the parameter labels must hold strings alone, got {value!r}")
        return tuple(label.strip() for label in value)
    if not isinstance(value, str):
        raise InvalidInput(f"the parameter labels must be a string of comma-separated labels, got {value!r}")
    return parse_labels(value)


def request_string(request: InferRequest, name: str) -> str | None:
    value = (request.parameters or {}).get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidInput(f"the parameter {name} must be a string, got {value!r}")
    return value


def request_flag(request: InferRequest, name: str) -> bool:
    value = (request.parameters or {}).get(name, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"the parameter {name} must be true or false, got {value!r}")
    return value


def check_outputs(request: InferRequest, intake: Intake) -> None:
    """Each output named is one the model gives, asked for as the protocol allows; ood_score from a model
    without reference statistics is left to the engine, whose refusal says how to add them."""
    listed = intake.outputs
    for output in request.outputs or []:
        if output.name not in listed and not (output.name == OOD_SCORE and every_output(listed)):
            gives = ", ".join(map(repr, listed))
            if output.name == TEXT_EMBEDDING and every_output(listed):
                raise InvalidInput(
                    f"output {TEXT_EMBEDDING!r} is a zero-shot model's (CLIP, SigLIP); this model gives {gives}"
                )
            if output.name in OUTPUT_NAMES:
                raise InvalidInput(
                    f"output {output.name!r} is not served here (VIT_V2_OUTPUTS=probabilities); this model "
                    f"gives {gives}"
                )
            raise InvalidInput(f"unknown output {output.name!r}; this model gives {gives}")
        params = output.parameters or {}
        if unknown := [name for name in params if name not in OUTPUT_PARAMETERS]:
            raise InvalidInput(
                f"output {output.name!r}: unknown parameter {unknown[0]!r}; an output takes "
                f"{', '.join(OUTPUT_PARAMETERS)}"
            )
        k = params.get("classification", 0)
        if output.name != PROBABILITIES and k:
            raise InvalidInput(f"classification applies to {PROBABILITIES!r}, not {output.name!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise InvalidInput(f"output {output.name!r}: classification must be a non-negative integer, got {k!r}")
        if SHM_REGION in params:
            what = f"output {output.name!r}"
            if k:
                raise InvalidInput(f"{what}: classification results are not written to shared memory (as in Triton)")
            if SHM_BYTE_SIZE not in params:
                raise InvalidInput(f"{what}: {SHM_REGION} needs {SHM_BYTE_SIZE}, the bytes the region gives it")
            intake.regions.check(params[SHM_REGION], params.get(SHM_OFFSET, 0), params[SHM_BYTE_SIZE], what)


def check_listed(options: InferOptions, intake: Intake) -> None:
    """A parameter asks only for outputs the server lists (VIT_V2_OUTPUTS=probabilities lists only those)."""
    if every_output(intake.outputs):
        return
    asked = [
        name
        for name, on in (
            ("attention", options.attention != "none"),
            ("embedding", options.embedding),
            ("ood", options.ood),
        )
        if on
    ]
    if asked:
        raise InvalidInput(
            f"the parameter {asked[0]} asks for an output this server does not give: it serves "
            f"{', '.join(map(repr, intake.outputs))} alone (VIT_V2_OUTPUTS=probabilities)"
        )
