"""Open Inference Protocol (KServe V2) REST routes: health, metadata and infer, over the same models,
batchers, limits, API keys and metrics as /predict. Errors are answered as {"error": "..."}."""

from __future__ import annotations

import copy
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from app.disconnects import ClientDisconnected, unless_disconnected
from app.errors import ModelNotFound, NotReady
from app.routes import ReadyServiceDep, check_api_key
from app.schemas import (
    V2Error,
    V2InferResponse,
    V2Live,
    V2ModelMetadata,
    V2ModelReady,
    V2Ready,
    V2ServerMetadata,
    V2TensorMetadata,
)
from app.served_model import ServedModel
from app.service import Service
from app.uploads import read_body
from app.v2_protocol import (
    ATTENTION,
    HEADER_LENGTH,
    IMAGE,
    PIXELS,
    PROBABILITIES,
    InferRequest,
    decode_request,
    encode_response,
    split_body,
)

SERVER_NAME = "vit-serve"
EXTENSIONS = ["binary_tensor_data", "classification"]

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol (V2)"])


def v2_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {
        400: "Malformed request or tensor (shape, datatype, size, undecodable image)",
        401: "API key missing or wrong (only when VIT_API_KEYS is set)",
        404: "No model (or version) of that name",
        413: "Body or image too large",
        503: "Overloaded (with Retry-After) or not ready",
        504: "Not answered within VIT_REQUEST_TIMEOUT_S",
    }
    return {s: {"model": V2Error, "description": described[s]} for s in statuses}


def inline_schema(model: type[InferRequest]) -> dict[str, Any]:
    """A model's JSON schema with its $defs inlined, for an OpenAPI requestBody."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]]))
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


INFER_BODY = {
    "requestBody": {
        "required": True,
        "description": "An inference request (JSON). With the binary tensor data extension, the JSON is followed "
        "by the tensors' bytes and its length is sent in the Inference-Header-Content-Length header.",
        "content": {
            "application/json": {"schema": inline_schema(InferRequest)},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "responses": {
        "200": {
            "description": "The outputs; with binary outputs, JSON then bytes (application/octet-stream)",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
}


def version_of(service: Service, name: str, version: str | None) -> ServedModel:
    model = service.model(name)
    if version is not None and version != model.checkpoint.version:
        raise ModelNotFound(f"model {name!r} has no version {version!r}; it serves version {model.checkpoint.version}")
    return model


@router.get("", response_model=V2ServerMetadata)
async def server_metadata(request: Request) -> V2ServerMetadata:
    """Server metadata: name, version and protocol extensions."""
    return V2ServerMetadata(name=SERVER_NAME, version=request.app.version, extensions=EXTENSIONS)


@router.get("/health/live", response_model=V2Live)
async def server_live() -> V2Live:
    """200 while the process serves."""
    return V2Live(live=True)


@router.get("/health/ready", response_model=V2Ready, responses=v2_errors(503))
async def server_ready(request: Request) -> V2Ready:
    """200 once every model is loaded and warm; 503 before that and while draining."""
    service: Service | None = request.app.state.service
    if service is None or not service.ready:
        raise NotReady("not ready: loading the models or draining")
    return V2Ready(ready=True)


@router.get("/models/{name}", response_model=V2ModelMetadata, responses=v2_errors(404, 503))
@router.get("/models/{name}/versions/{version}", response_model=V2ModelMetadata, responses=v2_errors(404, 503))
async def model_metadata(service: ReadyServiceDep, name: str, version: str | None = None) -> V2ModelMetadata:
    """A model's version, inputs (image or pixels) and outputs."""
    model = version_of(service, name, version)
    c, h, w = model.input_shape
    grid = model.checkpoint.config.grid_size
    return V2ModelMetadata(
        name=model.name,
        versions=[model.checkpoint.version],
        platform="pytorch",
        inputs=[
            V2TensorMetadata(name=IMAGE, datatype="BYTES", shape=[-1]),
            V2TensorMetadata(name=PIXELS, datatype="FP32", shape=[-1, c, h, w]),
        ],
        outputs=[
            V2TensorMetadata(name=PROBABILITIES, datatype="FP32", shape=[-1, len(model.classes)]),
            V2TensorMetadata(name=ATTENTION, datatype="FP32", shape=[-1, grid, grid]),
        ],
    )


@router.get("/models/{name}/ready", response_model=V2ModelReady, responses=v2_errors(404, 503))
@router.get("/models/{name}/versions/{version}/ready", response_model=V2ModelReady, responses=v2_errors(404, 503))
async def model_ready(service: ReadyServiceDep, name: str, version: str | None = None) -> V2ModelReady:
    """200 when the model is loaded and warm."""
    return V2ModelReady(name=version_of(service, name, version).name, ready=True)


INFER_ROUTE: dict[str, Any] = {
    "response_model": V2InferResponse,
    "response_model_exclude_none": True,
    "responses": v2_errors(400, 401, 404, 413, 503, 504),
    "openapi_extra": INFER_BODY,
    "dependencies": [Depends(check_api_key)],
}


@router.post("/models/{name}/infer", **INFER_ROUTE)
@router.post("/models/{name}/versions/{version}/infer", **INFER_ROUTE)
async def infer(request: Request, service: ReadyServiceDep, name: str, version: str | None = None) -> Response:
    """Inference: encoded images (BYTES `image`) or preprocessed pixels (FP32 `pixels`) in; probabilities,
    attention maps (request parameter `attention`) and classification strings out."""
    model = version_of(service, name, version)
    body = await read_body(request, service.settings.max_upload_bytes)
    header, binary = split_body(body, request.headers.get(HEADER_LENGTH))
    decoded = decode_request(header, binary, model.input_shape, service.settings.max_files)
    target = model.target_index(decoded.target)
    try:
        outputs = await unless_disconnected(
            request, service.compute(model, decoded.uploads, decoded.pixels, decoded.attention, target)
        )
    except ClientDisconnected:
        return Response(status_code=499)  # never delivered: the client is gone
    encoded = encode_response(decoded, outputs, model.classes, model.name, model.checkpoint.version)
    if encoded.header_length is None:
        return Response(encoded.body, media_type="application/json")
    headers = {"Inference-Header-Content-Length": str(encoded.header_length)}
    return Response(encoded.body, media_type="application/octet-stream", headers=headers)
