"""Open Inference Protocol requests over gRPC, built with the service's own messages, and how to expect an error."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest

from app.codecs.proto import messages_pb2 as pb


def length_prefixed(*elements: bytes) -> bytes:
    """BYTES elements as raw_input_contents carries them: each a 4-byte little-endian length, then its bytes."""
    return b"".join(len(e).to_bytes(4, "little") + e for e in elements)


def image_request(*files: bytes, raw: bool = True, model: str = "tiny", **parameters: Any) -> pb.ModelInferRequest:
    """An `image` input of these files, raw (as tritonclient sends it) or in typed contents, with parameters."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="image", datatype="BYTES", shape=[len(files)])
    if raw:
        request.raw_input_contents.append(length_prefixed(*files))
    else:
        tensor.contents.bytes_contents.extend(files)
    for key, value in parameters.items():
        setattr(
            request.parameters[key], {bool: "bool_param", int: "int64_param", str: "string_param"}[type(value)], value
        )
    return request


def probabilities(response: pb.ModelInferResponse) -> np.ndarray:
    [output] = [o for o in response.outputs if o.name == "probabilities"]
    index = list(response.outputs).index(output)
    return np.frombuffer(response.raw_output_contents[index], "<f4").reshape(list(output.shape))


async def expect(call: Any, code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    """Await `call`, which must fail with `code` and a message containing `message`."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    assert message in (caught.value.details() or ""), caught.value.details()
    return caught.value
