"""The Open Inference Protocol (KServe V2) on the wire: its tensor and parameter names, and the JSON bodies of
its requests and answers as pydantic models (what FastAPI validates and documents). The protocol itself, inputs,
outputs and extensions, is described in `app.codecs.v2_requests`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from app.choices import BACKENDS, Datatype, ModelState, Precision, Quantization, choices
from app.core.contract.request import (
    AttentionKind,
)

HEADER_LENGTH = "inference-header-content-length"
IMAGE, PIXELS, TEXT = "image", "pixels", "text"
PROBABILITIES, ATTENTION, EMBEDDING = "probabilities", "attention", "embedding"
OOD_SCORE, TEXT_EMBEDDING = "ood_score", "text_embedding"
OUTPUT_NAMES = (PROBABILITIES, ATTENTION, EMBEDDING, OOD_SCORE, TEXT_EMBEDDING)
IMAGE_OUTPUTS = (PROBABILITIES, ATTENTION, EMBEDDING, OOD_SCORE)  # what a request of images (or pixels) answers
DEFAULT_MAP: AttentionKind = "rollout"  # the map the output `attention` gives when no parameter chooses one
# The parameters that place an input's or output's bytes in a registered shared-memory region.
SHM_REGION, SHM_BYTE_SIZE, SHM_OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
# what an output may carry; another name (tritonclient's `class_count` sent raw, say) is refused, never ignored
OUTPUT_PARAMETERS = ("classification", "binary_data", SHM_REGION, SHM_OFFSET, SHM_BYTE_SIZE)


class V2Error(BaseModel):
    error: str = Field(examples=["input 'pixels' must have shape [-1, 1, 64, 64] for this model, got [1, 3, 64, 64]"])


class V2ServerMetadata(BaseModel):
    name: str = Field(examples=["vit-serve"])
    version: str = Field(examples=["0.1.0"])
    extensions: list[str] = Field(examples=[["binary_tensor_data", "classification"]])


class V2Live(BaseModel):
    live: bool


class V2Ready(BaseModel):
    ready: bool


class V2ModelReady(BaseModel):
    name: str
    ready: bool


class V2TensorMetadata(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int] = Field(description="-1 marks the batch dimension")


class V2ModelMetadata(BaseModel):
    name: str
    versions: list[str] = Field(description="The checkpoint's content-hash version")
    platform: str = Field(description="pytorch, or onnxruntime_onnx on the ONNX Runtime backends", examples=["pytorch"])
    parameters: dict[str, str] = Field(
        description=f"backend ({', '.join(BACKENDS)}), precision ({', '.join(choices(Precision))}) "
        f"and, with int8, quantization ({' or '.join(choices(Quantization))})",
        examples=[{"backend": "onnxruntime", "precision": "float32"}],
    )
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]


class V2TensorOut(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class V2InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[V2TensorOut]


class V2ModelIndex(BaseModel):
    name: str = Field(examples=["vit-shapes"])
    version: str = Field(description="The version serving, loading or last served ('' when never loaded)")
    state: ModelState = Field(description=f"{', '.join(choices(ModelState))}", examples=["READY"])
    reason: str = Field(description="Why it is UNAVAILABLE", examples=[""])


class V2Duration(BaseModel):
    count: int = Field(description="How many")
    ns: int = Field(description="Their total time, in nanoseconds")


class V2InferenceStats(BaseModel):
    success: V2Duration = Field(description="Requests answered, and their time in the core")
    fail: V2Duration = Field(description="Requests failed after their model was found")
    queue: V2Duration = Field(description="Waiting for a batch: from entering the batcher to the batch's start")
    compute_input: V2Duration = Field(description="Decoding and preprocessing, then the batch's copy or GPU decode")
    compute_infer: V2Duration = Field(description="The batch's forward pass, outputs copied back to the CPU")
    compute_output: V2Duration = Field(description="Outputs made into predictions: embeddings, overlays")
    cache_hit: V2Duration = Field(description="Images found in the response cache, and the lookup time")
    cache_miss: V2Duration = Field(description="Images not found there, and the lookup time")


class V2BatchStats(BaseModel):
    batch_size: int
    compute_input: V2Duration
    compute_infer: V2Duration
    compute_output: V2Duration


class V2ModelStat(BaseModel):
    name: str = Field(examples=["vit-shapes"])
    version: str = Field(examples=["1191dfd418c5"])
    last_inference: int = Field(description="Milliseconds since the epoch of the last request answered (0: none)")
    inference_count: int = Field(description="Images answered, computed or from the response cache")
    execution_count: int = Field(description="Forward passes")
    inference_stats: V2InferenceStats
    batch_stats: list[V2BatchStats] = Field(description="Per batch size, smallest first")


class V2Statistics(BaseModel):
    model_stats: list[V2ModelStat]


class V2IndexRequest(BaseModel):
    ready: bool = Field(False, description="Only the models that are READY")


class V2RepositoryRequest(BaseModel):
    parameters: dict[str, Any] | None = None


class TensorIn(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: Any = None


class OutputWanted(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[TensorIn]
    outputs: list[OutputWanted] | None = None
