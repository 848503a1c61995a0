"""The Open Inference Protocol over gRPC: protobuf messages to and from the V2 codec's types, no gRPC server.

A ModelInferRequest becomes the same `InferRequest` the REST edge parses from JSON, with its input's
elements from `raw_input_contents` (as tritonclient sends them; BYTES elements 4-byte little-endian
length-prefixed) or from typed `contents` (`bytes_contents` for BYTES, `fp32_contents` for FP32).
Outputs always go back in `raw_output_contents`, as Triton answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from app.choices import Datatype
from app.codecs.proto import messages_pb2 as pb
from app.codecs.v2_requests import Decoded, Intake, decode_infer
from app.codecs.v2_responses import answer_parameters, output_tensors
from app.codecs.v2_schemas import (
    SHM_REGION,
    InferRequest,
    OutputWanted,
    TensorIn,
    V2Duration,
    V2InferenceStats,
    V2ModelIndex,
    V2ModelMetadata,
    V2ServerMetadata,
    V2Statistics,
)
from app.codecs.v2_tensors import TensorData
from app.core.contract.description import ModelDescription
from app.core.contract.errors import InvalidInput
from app.core.contract.request import Prediction

# The typed contents field each datatype's data must be in (the protocol's rule).
CONTENTS_FIELD: dict[str, str] = {Datatype.BYTES: "bytes_contents", Datatype.FP32: "fp32_contents"}


def parameters(entries: Mapping[str, Any]) -> dict[str, Any] | None:
    """An InferParameter (or ModelRepositoryParameter) map as plain values; None when empty."""
    out = {}
    for key, parameter in entries.items():
        kind = parameter.WhichOneof("parameter_choice")
        out[key] = None if kind is None else getattr(parameter, kind)
    return out or None


def decode(message: pb.ModelInferRequest, intake: Intake) -> Decoded:
    """Check and decode one ModelInferRequest, as V2 REST does."""
    raw = message.raw_input_contents
    if raw and any(t.HasField("contents") for t in message.inputs):
        raise InvalidInput("send input data in raw_input_contents or in contents, not both")
    if raw and len(raw) != len(message.inputs):
        raise InvalidInput(f"{len(raw)} raw_input_contents for {len(message.inputs)} inputs; send one per input")

    if (
        message.inputs
        and SHM_REGION in message.inputs[0].parameters
        and (raw or message.inputs[0].HasField("contents"))
    ):
        raise InvalidInput(f"input {message.inputs[0].name!r} is in shared memory ({SHM_REGION}): send no data with it")

    def data_of(_: TensorIn) -> TensorData:
        return TensorData(raw=raw[0]) if raw else typed_data(message.inputs[0])

    return decode_infer(infer_request(message), data_of, intake)


def infer_request(message: pb.ModelInferRequest) -> InferRequest:
    """The request as the REST edge would have parsed it from JSON, its data left out."""
    try:
        return InferRequest(
            id=message.id or None,
            parameters=parameters(message.parameters),
            inputs=[
                TensorIn(name=t.name, shape=list(t.shape), datatype=t.datatype, parameters=parameters(t.parameters))
                for t in message.inputs
            ],
            outputs=[OutputWanted(name=o.name, parameters=parameters(o.parameters)) for o in message.outputs] or None,
        )
    except ValidationError as e:  # not reachable from well-formed protobuf, kept as the REST edge answers it
        raise InvalidInput(f"invalid inference request: {e.errors()[0]['msg']}") from None


def typed_data(tensor: pb.ModelInferRequest.InferInputTensor) -> TensorData:
    """The input's elements from its typed contents, which must be the field of its datatype."""
    contents = tensor.contents
    filled = [field.name for field, _ in contents.ListFields()]
    wanted = CONTENTS_FIELD.get(tensor.datatype)
    if not filled:
        return TensorData(elements=[]) if wanted == "bytes_contents" else TensorData(values=np.empty(0, np.float32))
    if filled != [wanted]:
        where = f"contents.{wanted} or raw_input_contents" if wanted else "raw_input_contents"
        raise InvalidInput(
            f"input {tensor.name!r} ({tensor.datatype}): send its data in {where}, not in {', '.join(filled)}"
        )
    if wanted == "bytes_contents":
        return TensorData(elements=list(contents.bytes_contents))
    return TensorData(values=np.asarray(contents.fp32_contents, dtype=np.float32))


def infer_response(
    decoded: Decoded,
    predictions: list[Prediction],
    model: ModelDescription,
    classes: list[str] | None = None,
    text_embeddings: torch.Tensor | None = None,
) -> pb.ModelInferResponse:
    """The outputs in raw_output_contents, or written to shared memory (with empty contents there, so that the
    contents keep the outputs' order); `classes` as in `v2.encode_response`."""
    outputs, contents = [], []
    for t in output_tensors(decoded, predictions, model.classes if classes is None else classes, text_embeddings):
        outputs.append(pb.ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=t.shape))
        if t.in_shared_memory():
            t.write_to_region(decoded.regions)
            contents.append(b"")
        else:
            contents.append(t.raw())
    described = {k: pb.InferParameter(string_param=v) for k, v in answer_parameters(decoded, model).items()}
    return pb.ModelInferResponse(
        model_name=model.name,
        model_version=model.version,
        id=decoded.request.id or "",
        parameters=described,
        outputs=outputs,
        raw_output_contents=contents,
    )


def server_metadata(metadata: V2ServerMetadata) -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(name=metadata.name, version=metadata.version, extensions=metadata.extensions)


def model_metadata(metadata: V2ModelMetadata) -> pb.ModelMetadataResponse:
    def tensors(ts: list[Any]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
        return [pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape) for t in ts]

    return pb.ModelMetadataResponse(
        name=metadata.name,
        versions=metadata.versions,
        platform=metadata.platform,
        inputs=tensors(metadata.inputs),
        outputs=tensors(metadata.outputs),
    )


def repository_index(models: list[V2ModelIndex]) -> pb.RepositoryIndexResponse:
    return pb.RepositoryIndexResponse(
        models=[
            pb.RepositoryIndexResponse.ModelIndex(name=m.name, version=m.version, state=m.state, reason=m.reason)
            for m in models
        ]
    )


def statistics_response(stats: V2Statistics) -> pb.ModelStatisticsResponse:
    """The statistics extension's JSON (`v2.statistics_response`) as its protobuf message."""

    def duration(d: V2Duration) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=d.count, ns=d.ns)

    def inference(i: V2InferenceStats) -> pb.InferStatistics:
        return pb.InferStatistics(**{name: duration(getattr(i, name)) for name in V2InferenceStats.model_fields})

    return pb.ModelStatisticsResponse(
        model_stats=[
            pb.ModelStatistics(
                name=m.name,
                version=m.version,
                last_inference=m.last_inference,
                inference_count=m.inference_count,
                execution_count=m.execution_count,
                inference_stats=inference(m.inference_stats),
                batch_stats=[
                    pb.InferBatchStatistics(
                        batch_size=b.batch_size,
                        compute_input=duration(b.compute_input),
                        compute_infer=duration(b.compute_infer),
                        compute_output=duration(b.compute_output),
                    )
                    for b in m.batch_stats
                ],
            )
            for m in stats.model_stats
        ]
    )
