"""One exception type per kind of failure a client can act on, mapped to HTTP in one place."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("app")


class ServiceError(Exception):
    """Base of the errors the service answers with; `status` is the HTTP status code."""

    status: int = 500

    def __init__(self, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers


class PayloadTooLarge(ServiceError):
    status = 413


class UnsupportedMediaType(ServiceError):
    status = 415


class InvalidInput(ServiceError):
    """Undecodable image, bad parameters, too many or no files."""

    status = 422


class Unauthorized(ServiceError):
    status = 401


class ModelNotFound(ServiceError):
    """A model name (or version) that this service does not serve."""

    status = 404


class Overloaded(ServiceError):
    status = 503


class NotReady(ServiceError):
    status = 503


class RequestTimeout(ServiceError):
    status = 504


class InferenceFailed(ServiceError):
    """The forward pass failed for an image even on its own (a server fault, not bad input)."""

    status = 500


V2_PREFIX = "/v2"
V2_BAD_REQUEST = {415, 422}  # the Open Inference Protocol answers any malformed request or tensor with 400


def error_response(
    request: Request, status: int, detail: object, headers: dict[str, str] | None = None
) -> JSONResponse:
    """{"detail": ...} for our API; {"error": ...} (and 400 for bad input) for the Open Inference Protocol."""
    if request.url.path == V2_PREFIX or request.url.path.startswith(V2_PREFIX + "/"):
        status = 400 if status in V2_BAD_REQUEST else status
        return JSONResponse({"error": str(detail)}, status_code=status, headers=headers)
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error becomes JSON `{"detail": ...}`; unexpected ones are logged, never shown."""

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(request, exc.status, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in e['loc'] if p not in ('query', 'body'))}: {e['msg']}" for e in exc.errors()
        ]
        return error_response(request, 422, "invalid request: " + "; ".join(problems))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, exc.status_code, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        request_id = request.scope.get("state", {}).get("request_id", "-")
        log.exception("unhandled error in %s %s (request %s)", request.method, request.url.path, request_id)
        return error_response(request, 500, f"internal error; quote request id {request_id} when reporting it")
