"""The HTTP edge's application: `create_app`, served by `uvicorn app.main:app`.

Settings are read and the model loaded in the lifespan, never at import; readiness turns green only
after the warm-up, and shutdown answers every accepted request before the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from pydantic import ValidationError

from app import __version__
from app.core.metrics import Metrics
from app.core.service import Service
from app.grpc.server import GrpcServer
from app.settings import Settings, configured_names, unknown_variables
from app.web.errors import install_error_handlers
from app.web.pages import install_pages
from app.web.predict_routes import router
from app.web.telemetry import RequestTelemetry
from app.web.v2_routes import router as v2_router
from model.checkpoint import CheckpointError

log = logging.getLogger("app")

DESCRIPTION = """
Vision Transformer image classification with dynamic batching. Try it in a browser at `/`.

`POST /predict` takes one image as multipart field `file`, several as repeated `files`, or the raw
bytes with an `image/*` Content-Type, and answers class probabilities for each image, plus attention
maps (`attention=rollout|last|gradient`), overlays (`overlay=true`) and embeddings (`embedding=true`) on request. The same models also
speak the Open Inference Protocol (KServe V2) under `/v2` (and over gRPC on VIT_GRPC_PORT), for Triton and KServe
clients, with Triton's model repository extension to load, reload and unload models at runtime.
"""


def configure_logging(level: str) -> None:
    """Log the app's lines to stderr beside uvicorn's, once per process."""
    logger = logging.getLogger("app")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


STARTUP_FAILED_EXIT_CODE = 3


def describe_startup_error(e: Exception) -> str:
    """One line that says what to fix."""
    if isinstance(e, ValidationError):
        problems = [f"VIT_{'.'.join(map(str, err['loc'])).upper()}: {err['msg']}" for err in e.errors()]
        return "invalid settings: " + "; ".join(problems)
    return str(e)


def create_app(settings: Settings | None = None, exit_on_startup_error: bool = False) -> FastAPI:
    """An app serving `settings` (default: read from VIT_* environment variables at startup).

    With `exit_on_startup_error` (the server's own app), a bad setting or checkpoint ends the process
    with one log line and exit code 3 instead of a traceback; otherwise the error propagates.
    """
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            resolved = settings or Settings()
            configure_logging(resolved.log_level)
            if settings is None:  # read from the environment: name the VIT_ variables that set nothing
                for message in unknown_variables(configured_names()):
                    log.warning(message)
            service = await asyncio.to_thread(Service.load, resolved, metrics)
            grpc_server = (
                GrpcServer(service, resolved.grpc_port, resolved.grpc_message_limit()) if resolved.grpc_port else None
            )
            if grpc_server is not None:
                await grpc_server.start()
        except (ValidationError, CheckpointError, ValueError, OSError) as e:
            if not exit_on_startup_error:
                raise
            configure_logging("info")
            log.critical("startup failed: %s", describe_startup_error(e))
            logging.shutdown()
            os._exit(STARTUP_FAILED_EXIT_CODE)  # nothing is serving yet: no socket is bound before startup
        service.start()
        app.state.service = service
        log.info("ready")
        try:
            yield
        finally:
            if grpc_server is not None:  # HTTP has drained (uvicorn stops it first); now gRPC, then the core
                await grpc_server.stop(resolved.drain_timeout_s)
            await service.shutdown()
            log.info("stopped")

    app = FastAPI(
        title="ViT serving",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.service = None  # until the lifespan has loaded the model
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(v2_router)  # the Open Inference Protocol (KServe V2) over the same models
    install_pages(app)  # the try-it page at /, and /docs and /redoc with local assets
    app.add_middleware(RequestTelemetry, metrics=metrics)
    return app
