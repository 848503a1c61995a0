"""The model configuration extension: how the service serves a model, as Triton's `ModelConfig`.

Triton's tools read it before they send anything (perf_analyzer its batch size, inputs and outputs;
model_analyzer the whole object, strictly against `model_config.proto`). It says what this service does,
not what Triton would: the inputs and outputs of `model_metadata`, one instance on the model's device, the
dynamic batcher's wait and queue, the response cache. gRPC answers it as the message, REST as Triton's
JSON form of it (every field printed, enums by name, 64-bit integers as strings).

- `max_batch_size` is VIT_MAX_FILES, the most images a request may carry (what a client of Triton reads it
  for); the batcher's own batch, VIT_MAX_BATCH_SIZE, which takes images of many requests, is the parameter
  `batcher_max_batch_size`.
- `image` has dims [1], one encoded file per batch element (the metadata's [-1, 1]; perf_analyzer cannot
  send a tensor without a dimension of its own); `pixels` is optional: a request sends one or the other.
- The queue policy's `max_queue_size` counts images, as VIT_MAX_QUEUE does, where Triton counts requests.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from app.codecs.proto import messages_pb2 as pb
from app.codecs.v2_metadata import listed_outputs, platform
from app.codecs.v2_schemas import ATTENTION, EMBEDDING, IMAGE, OOD_SCORE, PIXELS, PROBABILITIES, TEXT, TEXT_EMBEDDING
from app.core.contract.description import ModelDescription
from app.core.contract.inference import Batching, Limits


def model_config(model: ModelDescription, batching: Batching, limits: Limits) -> pb.ModelConfig:
    c, h, w = model.input_shape
    grid = model.grid_size
    gpu = model.device.startswith("cuda")
    outputs = {
        PROBABILITIES: pb.ModelOutput(
            name=PROBABILITIES, data_type=pb.TYPE_FP32, dims=[-1 if model.zero_shot else len(model.classes)]
        ),
        ATTENTION: pb.ModelOutput(name=ATTENTION, data_type=pb.TYPE_FP32, dims=[grid, grid]),
        EMBEDDING: pb.ModelOutput(name=EMBEDDING, data_type=pb.TYPE_FP32, dims=[model.embedding_dim]),
        # one value per image: [N], as Triton writes a per-item scalar (dims [1], reshaped to [])
        OOD_SCORE: pb.ModelOutput(name=OOD_SCORE, data_type=pb.TYPE_FP32, dims=[1], reshape=pb.ModelTensorReshape()),
        TEXT_EMBEDDING: pb.ModelOutput(name=TEXT_EMBEDDING, data_type=pb.TYPE_FP32, dims=[model.embedding_dim]),
    }
    return pb.ModelConfig(
        name=model.name,
        platform=platform(model),
        backend="pytorch" if model.backend == "torch" else "onnxruntime",
        version_policy=pb.ModelVersionPolicy(latest=pb.ModelVersionPolicy.Latest(num_versions=1)),
        max_batch_size=limits.max_files,
        input=[
            # `pixels` is optional where it is taken: a client sends one input or the other
            pb.ModelInput(name=IMAGE, data_type=pb.TYPE_STRING, dims=[1]),
            *(
                [
                    pb.ModelInput(
                        name=PIXELS,
                        data_type=pb.TYPE_FP32,
                        format=pb.ModelInput.FORMAT_NCHW,
                        dims=[c, h, w],
                        optional=True,
                    )
                ]
                if limits.takes_pixels
                else []
            ),
            # a zero-shot model's texts to embed, sent alone: one string per batch element
            *([pb.ModelInput(name=TEXT, data_type=pb.TYPE_STRING, dims=[1], optional=True)] if model.zero_shot else []),
        ],
        output=[outputs[name] for name in listed_outputs(model, limits.all_outputs)],
        instance_group=[
            pb.ModelInstanceGroup(
                name=model.name,
                kind=pb.ModelInstanceGroup.KIND_GPU if gpu else pb.ModelInstanceGroup.KIND_CPU,
                count=1,
                gpus=[gpu_index(model.device)] if gpu else [],
            )
        ],
        dynamic_batching=pb.ModelDynamicBatching(
            max_queue_delay_microseconds=round(batching.max_wait_ms * 1000),
            default_queue_policy=pb.ModelQueuePolicy(
                timeout_action=pb.ModelQueuePolicy.REJECT,
                default_timeout_microseconds=round(batching.request_timeout_s * 1e6),
                allow_timeout_override=True,  # a gRPC deadline shortens it
                max_queue_size=batching.max_queue,
            ),
        ),
        parameters={
            key: pb.ModelParameter(string_value=value)
            for key, value in {
                "version": model.version,
                "content_hash": model.content_hash,
                "batcher_max_batch_size": str(batching.max_batch_size),
                "precision": model.precision,
                "decode": model.decode,
                **({"quantization": model.quantization} if model.quantization else {}),
            }.items()
        },
        model_transaction_policy=pb.ModelTransactionPolicy(decoupled=False),
        response_cache=pb.ModelResponseCache(enable=batching.response_cache),
    )


def model_config_json(model: ModelDescription, batching: Batching, limits: Limits) -> dict[str, Any]:
    """Triton's JSON form: every field printed (defaults too), enums by name, proto field names."""
    return json_format.MessageToDict(
        model_config(model, batching, limits),
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )


def gpu_index(device: str) -> int:
    """The GPU of a torch device string: "cuda:1" is 1, "cuda" the first."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0
