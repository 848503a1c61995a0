"""Malformed ModelInfer requests: each gets its status code and a message saying what to fix, and the server
keeps serving. Built with the protocol's own messages, as any client could send them."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from app.codecs.proto import messages_pb2 as pb
from harness.images import encode
from model.shapes import make_sample
from tests.app.grpc.conftest import Edge
from tests.support.grpc_requests import expect, image_request, length_prefixed

PNG = encode(make_sample(9, 0).image)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def pixels(shape: list[int], raw: bytes | None = None, values: list[float] | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="pixels", datatype="FP32", shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    if values is not None:
        tensor.contents.fp32_contents.extend(values)
    return request


def with_parameter(request: pb.ModelInferRequest, name: str, kind: str, value: object) -> pb.ModelInferRequest:
    setattr(request.parameters[name], kind, value)
    return request


def two_inputs() -> pb.ModelInferRequest:
    request = image_request(PNG)
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(length_prefixed(PNG))
    return request


def raw_and_contents() -> pb.ModelInferRequest:
    request = image_request(PNG)
    request.inputs[0].contents.bytes_contents.append(PNG)
    return request


def wrong_contents_field() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="tiny")
    request.inputs.add(name="pixels", datatype="FP32", shape=[1, 3, 32, 32]).contents.int_contents.extend([1] * 3072)
    return request


def extra_raw() -> pb.ModelInferRequest:
    request = image_request(PNG)
    request.raw_input_contents.append(b"more")
    return request


def unknown_output() -> pb.ModelInferRequest:
    request = image_request(PNG)
    request.outputs.add(name="logits")
    return request


def classification_as_string() -> pb.ModelInferRequest:
    request = image_request(PNG)
    request.outputs.add(name="probabilities").parameters["classification"].string_param = "3"
    return request


def image_input(shape: list[int], raw: bytes, datatype: str = "BYTES", name: str = "image") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="tiny")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request


CASES: list[tuple[str, Callable[[], pb.ModelInferRequest], grpc.StatusCode, str]] = [
    ("no inputs", lambda: pb.ModelInferRequest(model_name="tiny"), INVALID, "send exactly one input"),
    ("two inputs", two_inputs, INVALID, "send exactly one input"),
    ("unknown input", lambda: image_input([1], length_prefixed(PNG), name="x"), INVALID, "unknown input 'x'"),
    ("unknown model", lambda: image_request(PNG, model="nope"), grpc.StatusCode.NOT_FOUND, "no model named 'nope'"),
    ("no model name", lambda: image_request(PNG, model=""), grpc.StatusCode.NOT_FOUND, "no model named ''"),
    (
        "unknown version",
        lambda: pb.ModelInferRequest(model_name="tiny", model_version="0"),
        grpc.StatusCode.NOT_FOUND,
        "no version '0'",
    ),
    (
        "element count below the shape",
        lambda: image_input([2], length_prefixed(PNG)),
        INVALID,
        "says 2 images, the data holds 1",
    ),
    (
        "element count above the shape",
        lambda: image_input([1], length_prefixed(PNG, PNG)),
        INVALID,
        "says 1 images, the data holds 2",
    ),
    ("length prefix cut short", lambda: image_input([1], b"\x05\x00"), INVALID, "ends inside the length prefix"),
    (
        "length prefix past the end",
        lambda: image_input([1], (1000).to_bytes(4, "little") + b"abc"),
        INVALID,
        "claims 1000 bytes, only 3 remain",
    ),
    ("huge length prefix", lambda: image_input([1], b"\xff\xff\xff\xff" + PNG), INVALID, "claims 4294967295 bytes"),
    ("not an image", lambda: image_request(b"plain text"), INVALID, "image[0]: not a recognised image"),
    ("image as FP32", lambda: image_input([1], length_prefixed(PNG), datatype="FP32"), INVALID, "must be BYTES"),
    ("image rank 3", lambda: image_input([1, 1, 1], length_prefixed(PNG)), INVALID, "must have shape [N] or [N, 1]"),
    ("negative batch", lambda: image_input([-1], length_prefixed(PNG)), INVALID, "has no images"),
    ("zero batch", lambda: image_input([0], b""), INVALID, "has no images"),
    ("overflowing batch", lambda: image_input([2**62], length_prefixed(PNG)), INVALID, "at most 16 are accepted"),
    ("too many images", lambda: image_request(*[PNG] * 17), INVALID, "at most 16 are accepted"),
    (
        "pixels of the wrong shape",
        lambda: pixels([1, 1, 32, 32], raw=b"\0" * 4096),
        INVALID,
        "must have shape [-1, 3, 32, 32]",
    ),
    ("pixels with a negative dimension", lambda: pixels([1, 3, -32, 32], raw=b""), INVALID, "must have shape"),
    (
        "pixel bytes short of the shape",
        lambda: pixels([1, 3, 32, 32], raw=b"\0" * 100),
        INVALID,
        "needs 12288 bytes of FP32, got 100",
    ),
    ("pixel bytes past the shape", lambda: pixels([1, 3, 32, 32], raw=b"\0" * 12292), INVALID, "needs 12288 bytes"),
    (
        "pixel values short of the shape",
        lambda: pixels([1, 3, 32, 32], values=[0.0] * 10),
        INVALID,
        "needs 3072 values, the data holds 10",
    ),
    ("pixels not finite", lambda: pixels([1, 3, 32, 32], values=[float("nan")] * 3072), INVALID, "NaN or infinite"),
    ("pixels with no data", lambda: pixels([1, 3, 32, 32]), INVALID, "needs 3072 values, the data holds 0"),
    ("raw and contents both", raw_and_contents, INVALID, "raw_input_contents or in contents, not both"),
    ("raw contents for no input", extra_raw, INVALID, "2 raw_input_contents for 1 inputs"),
    ("contents in the wrong field", wrong_contents_field, INVALID, "send its data in contents.fp32_contents"),
    (
        "attention as a number",
        lambda: with_parameter(image_request(PNG), "attention", "int64_param", 3),
        INVALID,
        "attention must be one of",
    ),
    (
        "attention unknown",
        lambda: with_parameter(image_request(PNG), "attention", "string_param", "gradcam"),
        INVALID,
        "attention must be one of",
    ),
    (
        "embedding as a string",
        lambda: with_parameter(image_request(PNG), "embedding", "string_param", "yes"),
        INVALID,
        "must be true or false",
    ),
    (
        "target as a double",
        lambda: with_parameter(image_request(PNG), "target", "double_param", 1.5),
        INVALID,
        "target must be a class label or index",
    ),
    (
        "target without gradient",
        lambda: with_parameter(image_request(PNG), "target", "int64_param", 1),
        INVALID,
        "also pass attention=gradient",
    ),
    ("unknown output", unknown_output, INVALID, "unknown output 'logits'"),
    ("classification as a string", classification_as_string, INVALID, "classification must be a non-negative integer"),
]


@pytest.mark.parametrize(("request_of", "code", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_malformed_requests_get_their_status(
    edge: Edge, request_of: Callable[[], pb.ModelInferRequest], code: grpc.StatusCode, message: str
) -> None:
    await expect(edge.stub.ModelInfer(request_of()), code, message)
    assert len((await edge.stub.ModelInfer(image_request(PNG))).outputs) == 1  # and it goes on serving


async def test_bytes_that_are_no_message_are_refused(edge: Edge) -> None:
    """A body that does not parse as a ModelInferRequest never reaches the edge."""
    channel = grpc.aio.insecure_channel(edge.server.address)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await infer(b"\xff\xff\xff\xff\xff")
        assert caught.value.code() == INVALID
        assert caught.value.details() == "the request is not a valid ModelInferRequest message"
    assert len((await edge.stub.ModelInfer(image_request(PNG))).outputs) == 1
