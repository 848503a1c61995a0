"""The HTTP edge's application: `create_app(data_plane)`, the routes of every HTTP protocol over one data plane."""

from __future__ import annotations

from fastapi import FastAPI

from app import __version__
from app.core.data_plane import DataPlane
from app.telemetry.tracing import tracing_configured
from app.web.errors import install_error_handlers
from app.web.middleware import AcceptedRequests, RequestTelemetry, http_telemetry
from app.web.pages import install_pages
from app.web.pages import router as pages_router
from app.web.predict_routes import router
from app.web.v2_routes import router as v2_router

DESCRIPTION = """
Vision Transformer image classification with dynamic batching. Try it in a browser at `/`.

`POST /predict` takes one image as multipart field `file`, several as repeated `files`, or the raw
bytes with an `image/*` Content-Type, and answers class probabilities for each image, plus attention
maps (`attention=rollout|last|gradient`), overlays (`overlay=true`) and embeddings (`embedding=true`) on request. The same models also
speak the Open Inference Protocol (KServe V2) under `/v2` (and over gRPC on VIT_GRPC_PORT), for Triton and KServe
clients, with Triton's model repository extension to load, reload and unload models at runtime.
"""


def create_app(data_plane: DataPlane) -> FastAPI:
    """The HTTP edge over `data_plane`: routes, error handlers and telemetry. It binds no port and loads
    nothing; `python -m app` (or `uvicorn app.main:app`) serves it."""
    app = FastAPI(
        title="ViT serving",
        version=__version__,
        description=DESCRIPTION,
        docs_url=None,
        redoc_url=None,
        telemetry=http_telemetry(tracing_configured()),  # a span per request when OTLP is configured
    )
    app.state.data_plane = data_plane
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(v2_router)  # the Open Inference Protocol (KServe V2) over the same models
    install_pages(app)  # the try-it page at /, and /docs and /redoc with local assets
    # the routes as each router declares them (APIRouter.routes), then the app's own (/openapi.json, the mounts)
    routes = [*router.routes, *v2_router.routes, *pages_router.routes, *app.router.routes]
    app.add_middleware(AcceptedRequests)  # inside the telemetry: its answers are counted and logged
    app.add_middleware(RequestTelemetry, metrics=data_plane.metrics, routes=routes)
    return app
