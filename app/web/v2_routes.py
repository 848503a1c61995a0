"""Open Inference Protocol (KServe V2) REST routes: health, metadata, infer and the model repository, over the data
plane, with the same models, batchers, limits, API keys and metrics as /predict. Errors are answered as {"error": "..."}."""

from __future__ import annotations

import copy
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn, TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from app.codecs.model_config import model_config_json
from app.codecs.shared_memory import V2RegisterSystemRegion, V2SystemRegionStatus, cuda_status, system_status
from app.codecs.v2_metadata import (
    check_load_parameters,
    model_metadata,
    repository_index,
    server_metadata,
    statistics_response,
)
from app.codecs.v2_requests import Decoded, decode_request, intake_for, split_body
from app.codecs.v2_responses import Encoded, encode_response
from app.codecs.v2_schemas import (
    HEADER_LENGTH,
    InferRequest,
    V2Error,
    V2IndexRequest,
    V2InferResponse,
    V2Live,
    V2ModelIndex,
    V2ModelMetadata,
    V2ModelReady,
    V2Ready,
    V2RepositoryRequest,
    V2ServerMetadata,
    V2Statistics,
)
from app.core.contract.errors import InvalidInput, NotSupported, validation_problems
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.regions import CUDA_NOT_SUPPORTED
from app.core.data_plane import DataPlane
from app.web.dependencies import AuthorizedPlane, Plane, ReadyPlane, ServingPlane, authorized_data_plane
from app.web.disconnects import respond_unless_disconnected
from app.web.errors import V2Route
from app.web.uploads import read_body

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol (V2)"], route_class=V2Route)
BodyT = TypeVar("BodyT", bound=BaseModel)
REPOSITORY_BODY_LIMIT = 64 * 1024


def v2_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {
        400: "Malformed request or tensor (shape, datatype, size, undecodable image); a model that failed to load, "
        "or a change the model control mode does not take; hostile or unknown shared memory, or CUDA shared memory "
        "(not supported)",
        401: "API key missing or wrong (only when VIT_API_KEYS is set)",
        404: "No model (or version), or shared-memory region, of that name",
        409: "A shared-memory region of that name is already registered",
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


INFER_ROUTE: dict[str, Any] = {
    "methods": ["POST"],
    "response_model": V2InferResponse,
    "response_model_exclude_none": True,
    "responses": v2_errors(400, 401, 404, 413, 503, 504),
    "openapi_extra": INFER_BODY,
}


class V2InferRoute(V2Route):
    """The infer routes. FastAPI documents them from the endpoint's signature, as any route, but the endpoint is called
    with its parameters resolved here: the plane as `authorized_data_plane` gives it, then the model's name and version
    (from the path, or on the unversioned route from the query's `version`: strings, as FastAPI would pass them).
    FastAPI's solving of them on every request cost V2 a share of a request's CPU that `/predict`, resolved so
    (`PredictEndpointRoute`), did not spend (docs/performance.md). It runs nothing else: a dependency added to the
    endpoint, the route or a router above it would be skipped, and a test holds the endpoint to these parameters."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            plane = await authorized_data_plane(request)
            path = request.path_params
            # the unversioned route takes a version from the query, as FastAPI reads the endpoint's `version` there
            version = path["version"] if "version" in path else request.query_params.get("version")
            response: Response = await endpoint(request, plane, path["name"], version)
            return response

        return handle


async def infer(request: Request, plane: AuthorizedPlane, name: str, version: str | None = None) -> Response:
    """Inference: encoded images (BYTES `image`) or preprocessed pixels (FP32 `pixels`) in; probabilities,
    attention maps (request parameter `attention`) and classification strings out."""
    model = plane.describe(name, version)
    body = await read_body(request, plane.limits.max_upload_bytes)
    header, binary = split_body(body, request.headers.get(HEADER_LENGTH))
    decoded = decode_request(header, binary, intake_for(model, plane.limits, plane.regions))
    asked = InferenceRequest(model, decoded.inputs, decoded.options, version, texts=decoded.texts)
    return await respond_unless_disconnected(request, answer(plane, asked, decoded))


# The infer routes come first: a request is matched against the routes in order, and these take the traffic.
router.add_api_route("/models/{name}/infer", infer, **INFER_ROUTE, route_class_override=V2InferRoute)
router.add_api_route("/models/{name}/versions/{version}/infer", infer, **INFER_ROUTE, route_class_override=V2InferRoute)


async def answer(plane: DataPlane, asked: InferenceRequest, decoded: Decoded) -> Response:
    def encode(done: Inference) -> Encoded:
        return encode_response(decoded, done.predictions, done.model, done.classes, done.text_embeddings)

    encoded = await plane.infer(asked, encode)
    if encoded.header_length is None:
        return Response(encoded.body, media_type="application/json")
    headers = {"Inference-Header-Content-Length": str(encoded.header_length)}
    return Response(encoded.body, media_type="application/octet-stream", headers=headers)


@router.get("", response_model=V2ServerMetadata)
async def server_metadata_route(plane: Plane) -> V2ServerMetadata:
    """Server metadata: name, version and protocol extensions."""
    return server_metadata(plane.regions.limit > 0)


@router.get("/health/live", response_model=V2Live)
async def server_live() -> V2Live:
    """200 while the process serves."""
    return V2Live(live=True)


@router.get("/health/ready", response_model=V2Ready, responses=v2_errors(503))
async def server_ready(_: ReadyPlane) -> V2Ready:
    """200 once every model is loaded and warm; 503 before that and while draining."""
    return V2Ready(ready=True)


@router.get("/models/stats", response_model=V2Statistics, responses=v2_errors(503))
async def all_statistics(plane: ServingPlane) -> V2Statistics:
    """Triton's statistics extension: requests, queue and compute times, cache hits and batch sizes of every
    model version that has served; tritonclient's get_inference_statistics."""
    return statistics_response(await plane.statistics())


@router.get("/models/{name}/stats", response_model=V2Statistics, responses=v2_errors(404, 503))
@router.get("/models/{name}/versions/{version}/stats", response_model=V2Statistics, responses=v2_errors(404, 503))
async def model_statistics(plane: ServingPlane, name: str, version: str | None = None) -> V2Statistics:
    """The statistics of one model's versions, or of one version."""
    return statistics_response(await plane.statistics(name, version))


@router.get("/models/{name}", response_model=V2ModelMetadata, responses=v2_errors(404, 503))
@router.get("/models/{name}/versions/{version}", response_model=V2ModelMetadata, responses=v2_errors(404, 503))
async def model_metadata_route(plane: ServingPlane, name: str, version: str | None = None) -> V2ModelMetadata:
    """A model's version, inputs (image or pixels) and outputs."""
    return model_metadata(plane.describe(name, version), plane.limits.takes_pixels, plane.limits.all_outputs)


@router.get("/models/{name}/config", responses=v2_errors(404, 503))
@router.get("/models/{name}/versions/{version}/config", responses=v2_errors(404, 503))
async def model_config_route(plane: ServingPlane, name: str, version: str | None = None) -> dict[str, Any]:
    """The model configuration extension: how the service serves the model, in Triton's JSON form of
    `ModelConfig` (what perf_analyzer and model_analyzer read first)."""
    return model_config_json(plane.describe(name, version), plane.batching, plane.limits)


@router.get("/models/{name}/ready", response_model=V2ModelReady, responses=v2_errors(404, 503))
@router.get("/models/{name}/versions/{version}/ready", response_model=V2ModelReady, responses=v2_errors(404, 503))
async def model_ready(plane: ReadyPlane, name: str, version: str | None = None) -> V2ModelReady:
    """200 when the model is loaded and warm."""
    return V2ModelReady(name=plane.describe(name, version).name, ready=True)


async def optional_body(request: Request, model: type[BodyT], limit: int) -> BodyT:
    """A small JSON body that may be left out (Triton's clients send none, or {} with parameters)."""
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        raise InvalidInput(f"invalid request body: {validation_problems(e.errors())}") from None


@router.post("/repository/index", response_model=list[V2ModelIndex], responses=v2_errors(400, 503))
async def repository_index_route(request: Request, plane: ServingPlane) -> list[V2ModelIndex]:
    """Every model of the repository (and those served from VIT_MODELS), its version, state and reason."""
    asked = await optional_body(request, V2IndexRequest, REPOSITORY_BODY_LIMIT)
    return repository_index(await plane.repository_index(asked.ready))


@router.post("/repository/models/{name}/load", responses=v2_errors(400, 401, 404, 503))
async def load_model(request: Request, plane: AuthorizedPlane, name: str) -> Response:
    """Load the model from the repository (VIT_MODEL_CONTROL=explicit); a loaded one is reloaded beside itself."""
    asked = await optional_body(request, V2RepositoryRequest, REPOSITORY_BODY_LIMIT)
    check_load_parameters(asked.parameters)
    await plane.load_model(name)
    return Response(status_code=200)


@router.post("/repository/models/{name}/unload", responses=v2_errors(400, 401, 404, 503))
async def unload_model(request: Request, plane: AuthorizedPlane, name: str) -> Response:
    """Stop admitting requests for the model, answer those admitted, then free it (VIT_MODEL_CONTROL=explicit)."""
    await optional_body(request, V2RepositoryRequest, REPOSITORY_BODY_LIMIT)  # unload_dependents: none here
    await plane.unload_model(name)
    return Response(status_code=200)


@router.get("/systemsharedmemory/status", response_model=list[V2SystemRegionStatus], responses=v2_errors(401, 503))
async def system_shared_memory_status(plane: AuthorizedPlane) -> list[V2SystemRegionStatus]:
    """The system shared-memory regions registered."""
    return system_status(plane.regions.status())


@router.get(
    "/systemsharedmemory/region/{region}/status",
    response_model=list[V2SystemRegionStatus],
    responses=v2_errors(401, 404, 503),
)
async def system_shared_memory_region_status(plane: AuthorizedPlane, region: str) -> list[V2SystemRegionStatus]:
    """The system shared-memory region named; 404 when none of that name is registered."""
    return system_status(plane.regions.status(region))


@router.post(
    "/systemsharedmemory/region/{region}/register",
    response_class=Response,
    responses=v2_errors(400, 401, 409, 413, 503),
)
async def register_system_shared_memory(request: Request, plane: AuthorizedPlane, region: str) -> Response:
    """Register `byte_size` bytes of the POSIX shared-memory object `key` from `offset` as a region: inputs
    may then be read from it and outputs written to it (parameters `shared_memory_region`,
    `shared_memory_byte_size`, `shared_memory_offset`)."""
    asked = await optional_body(request, V2RegisterSystemRegion, REPOSITORY_BODY_LIMIT)
    plane.regions.register(region, asked.key, asked.offset, asked.byte_size)
    return Response(status_code=200)


@router.post("/systemsharedmemory/unregister", response_class=Response, responses=v2_errors(401, 503))
async def unregister_all_system_shared_memory(plane: AuthorizedPlane) -> Response:
    """Forget every system shared-memory region."""
    plane.regions.unregister()
    return Response(status_code=200)


@router.post("/systemsharedmemory/region/{region}/unregister", response_class=Response, responses=v2_errors(401, 503))
async def unregister_system_shared_memory(plane: AuthorizedPlane, region: str) -> Response:
    """Forget the region named (nothing when there is none of that name)."""
    plane.regions.unregister(region)
    return Response(status_code=200)


@router.get("/cudasharedmemory/status", responses=v2_errors(401, 503))
async def cuda_shared_memory_status(plane: AuthorizedPlane) -> list[dict[str, object]]:
    """CUDA shared memory is not supported: no region is ever registered."""
    return cuda_status(None)


@router.get("/cudasharedmemory/region/{region}/status", responses=v2_errors(401, 404, 503))
async def cuda_shared_memory_region_status(plane: AuthorizedPlane, region: str) -> list[dict[str, object]]:
    """404: no CUDA shared-memory region is ever registered."""
    return cuda_status(region)


@router.post("/cudasharedmemory/region/{region}/register", response_model=None, responses=v2_errors(400, 401, 503))
async def register_cuda_shared_memory(plane: AuthorizedPlane, region: str) -> NoReturn:
    """Not supported: 400, saying so."""
    raise NotSupported(CUDA_NOT_SUPPORTED)


@router.post("/cudasharedmemory/unregister", response_class=Response, responses=v2_errors(401, 503))
@router.post("/cudasharedmemory/region/{region}/unregister", response_class=Response, responses=v2_errors(401, 503))
async def unregister_cuda_shared_memory(plane: AuthorizedPlane) -> Response:
    """Nothing to forget: succeeds, so that clients which clear both kinds of shared memory first go on."""
    return Response(status_code=200)


@router.api_route(
    "/{path:path}",
    methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"],
    include_in_schema=False,
    response_model=None,
)
async def unknown(request: Request) -> NoReturn:
    """Any other path under /v2: 404, or 405 where a V2 route takes the path with another method."""
    allowed = {
        method
        for route in router.routes
        if route is not request.scope.get("route") and route.matches(request.scope)[0] == Match.PARTIAL
        for method in getattr(route, "methods", ())
    }
    if allowed:
        raise StarletteHTTPException(405, headers={"Allow": ", ".join(sorted(allowed))})
    raise StarletteHTTPException(404)
