"""`POST /predict` and `/v1`: the response bodies (pydantic models that also document the OpenAPI schema),
and the functions that make them from the core's predictions and models."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import pydantic_core
import torch
from pydantic import BaseModel, Field

from app.choices import BACKENDS, Backend, DecodedOn, Precision, Quantization, choices
from app.core.contract.description import ModelDescription
from app.core.contract.request import AttentionKind, Prediction


class ModelRef(BaseModel):
    name: str = Field(examples=["vit-shapes"])
    version: str = Field(
        description="The version: the first 48 bits of the weights' content hash, in decimal",
        examples=["19318223149253"],
    )


class TopK(BaseModel):
    label: str = Field(examples=["star"])
    index: int = Field(
        description="Class index in the model's class order (a zero-shot request's: in the order of its labels)",
        examples=[5],
    )
    probability: float = Field(ge=0, le=1, examples=[0.987])


class AttentionMap(BaseModel):
    method: str = Field(description="rollout, last or gradient", examples=["rollout"])
    grid: list[int] = Field(description="[rows, columns] of the patch grid", examples=[[8, 8]])
    map: list[list[float]] = Field(description="Relevance of each patch, scaled to [0, 1]")


class ImageResult(BaseModel):
    filename: str = Field(examples=["star.png"])
    top_k: list[TopK]
    probabilities: list[float] = Field(
        description="One per class, in the model's class order; they sum to 1. A zero-shot model's: one per label "
        "named, by the model's rule (zero_shot.rule: softmax sums to 1; sigmoid scores each label alone)"
    )
    attention: AttentionMap | None = Field(None, description="Only when attention=rollout, last or gradient")
    overlay_png: str | None = Field(None, description="Base64 PNG of the map over the image; only when overlay=true")
    embedding: list[float] | None = Field(
        None,
        description="The pooled representation the classification head receives (model width values); a "
        "zero-shot model's: the image's embedding in the space it shares with text. Only when embedding=true, "
        "L2-normalised with normalize=true",
    )
    ood_score: float | None = Field(
        None,
        description="Distance of the image from the data the model's reference statistics came from (the "
        "Mahalanobis distance of its embedding to the nearest class mean; higher: further); only when ood=true",
        examples=[7.3],
    )
    ood: bool | None = Field(
        None, description="ood_score above the model's threshold (VIT_OOD_THRESHOLD); only when ood=true and one is set"
    )


class ZeroShotInfo(BaseModel):
    rule: str = Field(
        description="How label scores become probabilities: softmax over the labels named (CLIP), or the sigmoid "
        "of each alone (SigLIP)",
        examples=["softmax"],
    )
    template: str = Field(description="The prompt each label is set in by default", examples=["a photo of a {}."])


class PredictResponse(BaseModel):
    model: ModelRef
    results: list[ImageResult] = Field(description="One per uploaded image, in upload order")
    zero_shot: ZeroShotInfo | None = Field(
        None,
        description="A zero-shot model's answer: how its probabilities were computed (the rule) and the prompt its "
        "labels were set in; absent for a classifier",
    )
    head: str | None = Field(
        None,
        description="The head taught by example that answered (head=), whose classes the probabilities are over; "
        "absent without one",
    )


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
    backend: Backend = Field(
        description=f"What computes probabilities: {', '.join(BACKENDS)}", examples=["onnxruntime"]
    )
    precision: Precision = Field(
        description=f"The arithmetic of that computation: {', '.join(choices(Precision))}", examples=["float32"]
    )
    quantization: Quantization | None = Field(
        None,
        description="With int8: static (a graph calibrated ahead of time by python -m app.quantize) or dynamic",
        examples=["static"],
    )
    embedding_dim: int = Field(description="Length of an image's embedding (embedding=true)", examples=[192])
    reference: bool = Field(description="Whether the checkpoint has reference statistics, so ood=true scores images")
    ood_p99: float | None = Field(
        None,
        description="The out-of-distribution score that 99 in 100 images like the model's own data stay at or below "
        "(each scored by statistics fitted without it); above it, an image is unlike what the model knows. "
        "Absent for statistics made before it was kept",
        examples=[21.3],
    )
    ood_method: str | None = Field(
        None,
        description="What the out-of-distribution score is: mahalanobis (the distance of the image's embedding to "
        "the nearest class mean of the reference statistics) or max_softmax (1 - its top probability, for a model "
        "trained to answer equal probabilities for what it does not know); absent without reference statistics",
        examples=["mahalanobis"],
    )
    zero_shot: ZeroShotInfo | None = Field(
        None,
        description="A zero-shot model (CLIP, SigLIP): classes named per request (labels=); its `classes` are the "
        "labels used when a request names none, possibly none. Absent for a classifier",
    )
    decode: DecodedOn = Field(
        description="Where plain JPEGs are decoded: gpu (nvJPEG, a batch at a time; VIT_DECODE=auto on a GPU) or cpu",
        examples=["cpu"],
    )


class ModelList(BaseModel):
    default: str | None = Field(
        description="The model /predict uses without ?model= (null while none is loaded)", examples=["vit-shapes"]
    )
    models: list[ModelInfo]


class HeadEstimate(BaseModel):
    method: str = Field(description="How examples were held out: leave-one-out, or k-fold", examples=["5-fold"])
    accuracy: float = Field(description="Top-1 accuracy on the examples held out", examples=[0.96])
    examples: int


class HeadInfo(BaseModel):
    name: str = Field(examples=["parts"])
    classes: list[str] = Field(description="What its probabilities are over, in order", examples=[["ok", "dent"]])
    rule: str = Field(
        description="means: the scaled cosine to each class's mean embedding; logistic: an L2-penalised logistic "
        "regression, kept where it held out better",
        examples=["means"],
    )
    examples: dict[str, int] = Field(description="Example images each class was taught with")
    estimate: HeadEstimate | None = Field(
        description="Accuracy on examples held out while fitting; null where a class had one example"
    )
    backbone: str = Field(description="The content hash (short) of the model version it was taught on")
    embedding: str = Field(
        description="What it reads: pre-logits (a classifier's embedding) or joint (a zero-shot model's image)"
    )


class HeadList(BaseModel):
    model: ModelRef
    heads: list[HeadInfo]


class TaughtHeadInfo(HeadInfo):
    """A head just taught: itself, and the model it answers on."""

    model: ModelRef


def taught_head(model: ModelDescription, name: str, head: Mapping[str, Any]) -> TaughtHeadInfo:
    return TaughtHeadInfo(name=name, model=ModelRef(name=model.name, version=model.version), **head)


def heads_of(model: ModelDescription) -> HeadList:
    """The heads taught by example on `model`, by name."""
    return HeadList(
        model=ModelRef(name=model.name, version=model.version),
        heads=[HeadInfo(name=name, **head) for name, head in sorted(model.heads.items())],
    )


class ShadowComparison(BaseModel):
    champion: str = Field(examples=["vit-shapes"])
    challenger: str = Field(examples=["vit-shapes-next"])
    fraction: float = Field(
        description="Share of the champion's images also computed by the challenger", examples=[1.0]
    )
    compared: int = Field(description="Images both models computed", examples=[1000])
    top1_agreement: float | None = Field(
        description="Share of the compared images with the same top-1 class (null before the first)", examples=[0.97]
    )
    mean_tv_distance: float | None = Field(
        description="Mean total variation distance between the two probability vectors, 0 to 1", examples=[0.021]
    )
    shed: int = Field(
        description="Images picked for the challenger but not computed (load, or a failure)", examples=[0]
    )
    champion_p50_ms: float | None = Field(description="Median time from submission to answer, per request")
    challenger_p50_ms: float | None = Field(description="The same for the challenger's shadow requests")


class ErrorBody(BaseModel):
    detail: str = Field(examples=["photo.tif: TIFF images are not supported; send one of image/bmp, image/gif, ..."])


class Health(BaseModel):
    status: str = Field(examples=["ok"])


# what /v1/models says of a model as the description holds it
DESCRIBED = (
    "name", "version", "content_hash", "classes", "config", "preprocessing", "training", "device", "backend", "dtype",
    "precision", "quantization", "embedding_dim", "reference", "ood_p99", "ood_method", "decode",
)  # fmt: skip


def model_info(model: ModelDescription) -> ModelInfo:
    channels, height, width = model.input_shape
    zero_shot = (
        None
        if model.zero_shot is None or model.template is None
        else ZeroShotInfo(rule=model.zero_shot, template=model.template)
    )
    return ModelInfo(
        **{field: getattr(model, field) for field in DESCRIBED},
        input_size=[height, width],
        channels=channels,
        zero_shot=zero_shot,
    )


def image_result(prediction: Prediction, classes: list[str], top_k: int, attention: AttentionKind) -> dict[str, Any]:
    """One image's result as `ImageResult` lays it out: top-k, all probabilities, the map and the overlay
    when there are some."""
    probs = prediction.probabilities
    values, indices = torch.topk(probs, min(top_k, len(classes)))
    result: dict[str, Any] = {
        "filename": prediction.filename,
        "top_k": [
            {"label": classes[i], "index": i, "probability": p}
            for p, i in zip(values.tolist(), indices.tolist(), strict=True)
        ],
        "probabilities": probs.tolist(),
    }
    grid = prediction.attention_map
    if grid is not None:
        result["attention"] = {"method": attention, "grid": [grid.shape[0], grid.shape[1]], "map": grid.tolist()}
    if prediction.overlay_png is not None:
        result["overlay_png"] = base64.b64encode(prediction.overlay_png).decode("ascii")
    if prediction.embedding is not None:
        result["embedding"] = prediction.embedding.tolist()
    if prediction.ood_score is not None:
        result["ood_score"] = prediction.ood_score
    if prediction.ood is not None:
        result["ood"] = prediction.ood
    return result


def encode_predict_response(
    model: ModelDescription,
    predictions: list[Prediction],
    top_k: int,
    attention: AttentionKind,
    classes: list[str] | None = None,
    template: str | None = None,
    head: str | None = None,
) -> bytes:
    """The /predict JSON body for one request's predictions: `PredictResponse`, fields unset left out.

    Built as plain dicts and lists in the models' field order and serialized by pydantic's serializer, the
    one `model_dump_json` uses (far faster than json.dumps on long probability lists), without building and
    validating a model per top-k entry, which for a few classes costs more than the serialization. The values
    are the core's, of the models' types; tests/app/codecs/test_predict.py checks that the body is the one the models make. `classes`
    are a zero-shot request's labels or a head's classes (default: the model's classes), `template` a zero-shot
    request's prompt (default the model's), `head` the head taught by example that answered."""
    named = model.classes if classes is None else classes
    response: dict[str, Any] = {
        "model": {"name": model.name, "version": model.version},
        "results": [image_result(p, named, top_k, attention) for p in predictions],
    }
    if head is not None:  # its classes, over the model's embeddings
        response["head"] = head
    elif model.zero_shot is not None:
        response["zero_shot"] = {"rule": model.zero_shot, "template": template or model.template}
    return pydantic_core.to_json(response)
