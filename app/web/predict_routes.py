"""`POST /predict`, `/v1`, health and metrics: thin routes over the data plane."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, get_origin

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import QueryParams

from app.codecs.predict import (
    ErrorBody,
    HeadList,
    Health,
    ModelInfo,
    ModelList,
    PredictResponse,
    ShadowComparison,
    TaughtHeadInfo,
    encode_predict_response,
    heads_of,
    taught_head,
)
from app.codecs.predict import model_info as describe
from app.core.contract.errors import InvalidInput
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.request import AttentionKind, InferOptions, parse_labels
from app.core.contract.teaching import Lesson
from app.core.data_plane import DataPlane
from app.web.dependencies import AuthorizedPlane, Plane, ReadyPlane, ServingPlane, authorized_data_plane
from app.web.disconnects import respond_unless_disconnected
from app.web.errors import PredictRoute
from app.web.uploads import read_examples, read_images
from model.taught_head import RuleSetting

router = APIRouter(route_class=PredictRoute)

ERRORS = {
    s: {"model": ErrorBody, "description": d}
    for s, d in {
        401: "API key missing or wrong (only when VIT_API_KEYS is set)",
        404: "No model of that name",
        413: "Body or image too large",
        415: "Not a supported image type",
        422: "Undecodable image, bad parameters, no file or too many files",
        503: "Overloaded (with Retry-After) or not ready",
        504: "Not answered within VIT_REQUEST_TIMEOUT_S",
    }.items()
}
ERRORS_400 = {
    "model": ErrorBody,
    "description": "Teaching over the API is off (VIT_TEACH_MAX_EXAMPLES=0), or the heads folder cannot be written",
}
ERRORS_409 = {"model": ErrorBody, "description": "A head of that name exists (replace=true replaces it)"}
PREDICT_BODY = {
    "requestBody": {
        "required": True,
        "description": "One image as multipart field `file`, several as repeated `files`, or the raw bytes with an image/* Content-Type.",
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "files": {"type": "array", "items": {"type": "string", "format": "binary"}, "minItems": 1},
                    },
                    "anyOf": [{"required": ["file"]}, {"required": ["files"]}],
                }
            },
            "image/*": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


class PredictQuery(BaseModel):
    """/predict's query parameters; any other is a 422 that names it (a misspelt option is never ignored)."""

    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(5, ge=1, le=1000, description="How many top classes to list")
    attention: AttentionKind = Field(
        "none", description="Attention map to return: rollout or last (class-agnostic), gradient (for one class)"
    )
    overlay: bool = Field(False, description="Also return a PNG of the map over the image (base64)")
    model: str | None = Field(None, description="Which served model (default: the first)")
    target: str | None = Field(
        None, description="With attention=gradient: the class (label or index) to explain; default top-1"
    )
    embedding: bool = Field(
        False, description="Also return each image's embedding (what the classification head receives)"
    )
    normalize: bool = Field(False, description="With embedding=true: L2-normalise it")
    ood: bool = Field(
        False,
        description="Also score how far each image lies from the model's reference data (ood_score; higher: "
        "further) and, where VIT_OOD_THRESHOLD is set, flag it (ood)",
    )
    labels: str | None = Field(
        None,
        description="A zero-shot model (CLIP, SigLIP): the classes to choose among, comma-separated, in answer order "
        "(default: the model's own labels)",
        examples=["cat,dog,a red car"],
    )
    label: list[str] = Field(
        [], description="A zero-shot model: one more class, repeated for each, taken whole (a label with a comma)"
    )
    template: str | None = Field(
        None,
        description="A zero-shot model: the prompt each label is set in, {} where it goes (default: the model's own)",
        examples=["a photo of a {}."],
    )
    head: str | None = Field(
        None,
        description="A head taught by example on the model (GET /v1/models/{name}/heads): answer with its classes",
        examples=["parts"],
    )


REPEATED = frozenset(name for name, f in PredictQuery.model_fields.items() if get_origin(f.annotation) is list)


def read_query(params: QueryParams) -> PredictQuery:
    """The query as FastAPI reads a `Query()` model, without its introspection of each field on every request:
    the last value of a plain field, every value of a list field, then any other name (which the model refuses)
    with its value, or its values where it is repeated. A bad query is the RequestValidationError FastAPI raises,
    each error located in `query`."""
    given: dict[str, Any] = {}
    for name in PredictQuery.model_fields:
        if name in params:
            given[name] = params.getlist(name) if name in REPEATED else params[name]
    others: dict[str, list[str]] = {}
    for key, value in params.multi_items():
        if key not in PredictQuery.model_fields:
            others.setdefault(key, []).append(value)
    given.update((key, values[0] if len(values) == 1 else values) for key, values in others.items())
    try:
        return PredictQuery.model_validate(given)
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("query", *error["loc"])} for error in e.errors()]) from None


class PredictEndpointRoute(PredictRoute):
    """`POST /predict`'s route. FastAPI documents it from the endpoint's signature, as any route, but the endpoint
    is called with its parameters resolved here: the plane as `authorized_data_plane` gives it, then the query as
    `read_query` reads it (the order in which FastAPI would solve them). FastAPI's solving of them, field by field
    through the query model, was a large share of a front-end's CPU per request (docs/performance.md). It runs nothing
    else: a dependency added to the endpoint, the route or a router above it would be skipped, and a test holds the
    endpoint to these three parameters."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            plane = await authorized_data_plane(request)
            return await endpoint(request, plane, read_query(request.query_params))

        return handle


async def predict(request: Request, plane: AuthorizedPlane, query: Annotated[PredictQuery, Query()]) -> Response:
    """Classify one or more images; optionally return attention maps, overlays and embeddings."""
    labels = parse_labels(query.labels, query.label)
    q = query
    options = InferOptions(
        q.attention, q.target, q.overlay, q.embedding, q.normalize, q.ood, labels, q.template, head=q.head
    )
    model = plane.describe(q.model)  # an unknown model is answered before the body is read
    images = await read_images(request, plane.limits.max_upload_bytes, plane.limits.max_files)
    return await respond_unless_disconnected(request, answer(plane, InferenceRequest(model, images, options), q.top_k))


router.add_api_route(
    "/predict",
    predict,
    methods=["POST"],
    response_model=PredictResponse,
    response_model_exclude_none=True,
    responses=ERRORS,  # type: ignore[arg-type]
    openapi_extra=PREDICT_BODY,
    summary="Classify images",
    route_class_override=PredictEndpointRoute,
)


async def answer(plane: DataPlane, asked: InferenceRequest, top_k: int) -> Response:
    def encode(done: Inference) -> bytes:
        options = asked.options
        return encode_predict_response(
            done.model, done.predictions, top_k, options.attention, done.classes, options.template, options.head
        )

    return Response(await plane.infer(asked, encode), media_type="application/json")


@router.get("/v1/model", response_model=ModelInfo, responses={404: ERRORS[404], 503: ERRORS[503]})
async def model_info(plane: ServingPlane) -> ModelInfo:
    """Describe the default model: classes, input, config, training summary."""
    return describe(plane.describe(None))


@router.get("/v1/models", response_model=ModelList, responses={503: ERRORS[503]})
async def list_models(plane: ServingPlane) -> ModelList:
    """Every served model, the default first."""
    models = plane.models()
    return ModelList(default=models[0].name if models else None, models=[describe(m) for m in models])


@router.get("/v1/models/{name}/heads", response_model=HeadList, responses={404: ERRORS[404], 503: ERRORS[503]})
async def list_heads(name: str, plane: ServingPlane) -> HeadList:
    """The heads taught by example on a model (ask one with /predict?head=NAME or V2's parameter head)."""
    return heads_of(plane.describe(name))


class TeachQuery(BaseModel):
    """What teaching a head takes besides its examples; any other name is a 422 that names it."""

    model_config = ConfigDict(extra="forbid")

    rule: RuleSetting = Field(
        "auto",
        description="means: each class's mean embedding; logistic: an L2-penalised logistic regression; auto: "
        "logistic where it holds out better",
    )
    replace: bool = Field(False, description="Replace a head of that name (otherwise 409)")
    folder: str | None = Field(
        None,
        description="Teach from a folder of the model repository, FOLDER/<class>/*.jpg, instead of the body's files",
        examples=["examples/parts"],
    )


TEACH_BODY = {
    "requestBody": {
        "required": False,
        "description": "Each class's images as files under the class's name (multipart/form-data), in answer order; "
        "none with folder=.",
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "additionalProperties": {"type": "array", "items": {"type": "string", "format": "binary"}},
                }
            }
        },
    }
}


@router.post(
    "/v1/models/{name}/heads/{head}",
    response_model=TaughtHeadInfo,
    status_code=201,
    responses={**ERRORS, 400: ERRORS_400, 409: ERRORS_409},  # type: ignore[dict-item]
    openapi_extra=TEACH_BODY,
)
async def teach_head(
    name: str, head: str, request: Request, plane: AuthorizedPlane, query: Annotated[TeachQuery, Query()]
) -> TaughtHeadInfo:
    """Teach the model a head by example: its images are embedded on the model's own batches and a head fitted on
    them, kept in the model repository and answering at once (/predict?head=HEAD, V2's parameter head)."""
    model = plane.describe(name)  # an unknown model is answered before the body is read
    if query.folder is not None:
        if request.headers.get("content-length", "0") not in ("", "0"):
            raise InvalidInput("folder= names where the examples are: send no body with it")
        examples = await plane.run_in_pool(plane.examples_in, query.folder)
    else:
        plane.check_teaching()
        examples = await read_examples(request, plane.settings.teach_max_bytes, plane.settings.teach_max_examples)
    lesson = Lesson(head, examples, query.rule, query.replace)
    return taught_head(model, head, await plane.teach(model.name, lesson))


@router.delete(
    "/v1/models/{name}/heads/{head}",
    status_code=204,
    responses={**ERRORS, 400: ERRORS_400},  # type: ignore[dict-item]
)
async def delete_head(name: str, head: str, plane: AuthorizedPlane) -> Response:
    """Delete a head taught on the model: its file is removed, and requests naming it are not found from now on."""
    await plane.delete_head(plane.describe(name).name, head)
    return Response(status_code=204)


@router.get("/v1/models/{name}/shadow", response_model=ShadowComparison, responses={404: ERRORS[404], 503: ERRORS[503]})
async def shadow(name: str, plane: ServingPlane) -> ShadowComparison:
    """How the model's shadow challenger (VIT_SHADOW) compares with it on the same live images so far."""
    return ShadowComparison(**dataclasses.asdict(await plane.shadow_report(name)))


@router.get("/health/live", response_model=Health)
async def live() -> Health:
    """Liveness: 200 while the process serves."""
    return Health(status="ok")


@router.get("/health/ready", response_model=Health, responses={503: ERRORS[503]})
async def ready(_: ReadyPlane) -> Health:
    """Readiness: 200 once every model is loaded and warm; 503 before that and while draining."""
    return Health(status="ready")


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(plane: Plane) -> Response:
    """Prometheus metrics."""
    return Response(plane.metrics.render(), media_type=CONTENT_TYPE_LATEST)
