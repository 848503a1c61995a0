"""Response bodies of the API, as pydantic models (they also document the OpenAPI schema)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from model.rollout import MapMethod

AttentionParam = Literal["none", MapMethod]  # the `attention` choice of /predict and of V2 requests


class ModelRef(BaseModel):
    name: str = Field(examples=["vit-shapes"])
    version: str = Field(description="Short content hash of the checkpoint's weights", examples=["3f2a9c1d0b7e"])


class TopK(BaseModel):
    label: str = Field(examples=["star"])
    index: int = Field(description="Class index in the model's class order", examples=[5])
    probability: float = Field(ge=0, le=1, examples=[0.987])


class AttentionMap(BaseModel):
    method: str = Field(description="rollout, last or gradient", examples=["rollout"])
    grid: list[int] = Field(description="[rows, columns] of the patch grid", examples=[[8, 8]])
    map: list[list[float]] = Field(description="Relevance of each patch, scaled to [0, 1]")


class ImageResult(BaseModel):
    filename: str = Field(examples=["star.png"])
    top_k: list[TopK]
    probabilities: list[float] = Field(description="One per class, in the model's class order; they sum to 1")
    attention: AttentionMap | None = Field(None, description="Only when attention=rollout, last or gradient")
    overlay_png: str | None = Field(None, description="Base64 PNG of the map over the image; only when overlay=true")


class PredictResponse(BaseModel):
    model: ModelRef
    results: list[ImageResult] = Field(description="One per uploaded image, in upload order")


class ModelInfo(BaseModel):
    name: str
    version: str
    content_hash: str
    classes: list[str]
    input_size: list[int] = Field(description="[height, width] the model takes", examples=[[64, 64]])
    channels: int
    config: dict[str, Any]
    preprocessing: dict[str, Any]
    training: dict[str, Any]
    device: str
    dtype: str
    backend: str = Field(description="What computes probabilities: torch or onnxruntime", examples=["onnxruntime"])


class ModelList(BaseModel):
    default: str = Field(description="The model /predict uses without ?model=", examples=["vit-shapes"])
    models: list[ModelInfo]


class ErrorBody(BaseModel):
    detail: str = Field(examples=["photo.tif: TIFF images are not supported; send one of image/bmp, image/gif, ..."])


class Health(BaseModel):
    status: str = Field(examples=["ok"])


# Open Inference Protocol (V2) bodies.


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
    datatype: str
    shape: list[int] = Field(description="-1 marks the batch dimension")


class V2ModelMetadata(BaseModel):
    name: str
    versions: list[str] = Field(description="The checkpoint's content-hash version")
    platform: str = Field(examples=["pytorch"])
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
