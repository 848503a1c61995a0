"""Errors as HTTP answers: one status table per protocol, chosen by the router the error came through.

`/predict` and `/v1` answer `{"detail": ...}`; the Open Inference Protocol answers `{"error": ...}`
and 400 for any malformed request. A route's class names its protocol (`PredictRoute`, `V2Route`);
errors outside any route (an unknown path) are answered as `/predict` answers them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.core.contract import errors

log = logging.getLogger("app")
KEY_HINT = "send it in the X-API-Key header, or as Authorization: Bearer KEY"  # how HTTP carries an API key

PREDICT_STATUS: dict[type[errors.ServiceError], int] = {
    errors.PayloadTooLarge: 413,
    errors.UnsupportedMediaType: 415,
    errors.InvalidInput: 422,
    errors.Unauthorized: 401,
    errors.ModelNotFound: 404,
    errors.Overloaded: 503,
    errors.NotReady: 503,
    errors.Draining: 503,
    errors.RequestTimeout: 504,
    errors.InferenceFailed: 500,
    errors.LoadFailed: 400,
    errors.NotAllowed: 400,
    errors.AlreadyExists: 409,
    errors.RegionNotFound: 404,
    errors.NotSupported: 400,
}
# The Open Inference Protocol answers any malformed request or tensor with 400.
V2_STATUS: dict[type[errors.ServiceError], int] = {
    **PREDICT_STATUS,
    errors.UnsupportedMediaType: 400,
    errors.InvalidInput: 400,
}


@dataclass(frozen=True)
class ErrorProtocol:
    statuses: dict[type[errors.ServiceError], int]
    field: str  # the body's one key: "detail" or "error"
    bad_request: frozenset[int]  # statuses the protocol answers as 400 instead

    def status_of(self, error: errors.ServiceError) -> int:
        return self.statuses.get(type(error), 500)

    def response(self, status: int, detail: object, headers: dict[str, str] | None = None) -> JSONResponse:
        status = 400 if status in self.bad_request else status
        body = {self.field: detail if self.field == "detail" else str(detail)}
        return JSONResponse(body, status_code=status, headers=headers)


PREDICT_ERRORS = ErrorProtocol(PREDICT_STATUS, "detail", frozenset())
V2_ERRORS = ErrorProtocol(V2_STATUS, "error", frozenset({415, 422}))


class PredictRoute(APIRoute):
    """A route of `/predict`, `/v1` and the health and metrics endpoints."""

    errors = PREDICT_ERRORS


class V2Route(APIRoute):
    """A route of the Open Inference Protocol."""

    errors = V2_ERRORS


def protocol_of(request: Request) -> ErrorProtocol:
    """The error protocol of the route that matched the request (fully, or all but the method)."""
    return getattr(request.scope.get("route"), "errors", PREDICT_ERRORS)


def install_error_handlers(app: FastAPI) -> None:
    """Every error becomes its protocol's JSON; unexpected ones are logged, never shown."""

    @app.exception_handler(errors.ServiceError)
    async def service_error(request: Request, exc: errors.ServiceError) -> JSONResponse:
        protocol = protocol_of(request)
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        if isinstance(exc, errors.Draining):  # the client's next request opens a connection, to another replica
            headers = {"Connection": "close"}
        detail = f"{exc.detail}; {KEY_HINT}" if isinstance(exc, errors.Unauthorized) else exc.detail
        return protocol.response(protocol.status_of(exc), detail, headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return protocol_of(request).response(422, "invalid request: " + errors.validation_problems(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return protocol_of(request).response(exc.status_code, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        request_id = request.scope.get("state", {}).get("request_id", "-")
        log.exception("unhandled error in %s %s (request %s)", request.method, request.url.path, request_id)
        return protocol_of(request).response(500, f"internal error; quote request id {request_id} when reporting it")
