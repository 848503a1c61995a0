"""ASGI middleware: a request ID on every request and response, one access log line, HTTP metrics; each request
held as accepted by the data plane while it runs (the drain waits for it); and the settings of FastAPI's own
OpenTelemetry instrumentation, which opens each request's server span."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import secrets
import time
from collections.abc import Sequence

from fastapi.telemetry import TelemetryConfig
from opentelemetry import trace
from starlette.requests import Request
from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.data_plane import DataPlane
from app.telemetry.metrics import Metrics
from app.web.errors import protocol_of

log = logging.getLogger("app.access")
VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


class RequestIds:
    """Request ids of 32 hex digits, unique across processes and restarts: a random half drawn once per
    process (a fork draws again), then a count. A uuid4 per request read the system's random source each
    time, a cost every request paid."""

    def __init__(self) -> None:
        self.pid = -1
        self.prefix = ""
        self.count = itertools.count()

    def next(self) -> str:
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.prefix = secrets.token_hex(8)
            self.count = itertools.count()
        return f"{self.prefix}{next(self.count):016x}"


request_ids = RequestIds()


UNTRACED = frozenset({"/metrics", "/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"})


def untraced(scope: Scope) -> bool:
    """Probes and scrapes: no span, no access line."""
    return scope["path"] in UNTRACED


def http_telemetry(traced: bool) -> TelemetryConfig:
    """FastAPI's native OpenTelemetry instrumentation, as this service uses it: with `traced` (an OTLP
    endpoint configured, app.telemetry.tracing), a server span per request but the probes and scrapes, continuing an
    incoming W3C `traceparent` and named `{method} {route}` after the route's template. Its metrics and logs
    stay off (the service has its own, below), and so do its spans per dependency, endpoint and
    serialization: the core's spans say where a request's time went."""
    return {
        "tracing": traced,
        "metrics": False,
        "logs": False,
        "operation_spans": False,
        "auto_configure": False,  # the provider and its exporter are app.telemetry.tracing's
        "exclude": untraced,
    }


VERSION_SEGMENT = "/versions/{version}"


class RouteLabels:
    """Each request's route template as the app's router matches it (`/v2/models/{name}/infer`), through
    Starlette's public `BaseRoute.matches`, a V2 route's version left out (a versioned call counts with its model's
    route, as it always has); a path no route has (or only a catch-all) is "other". A bounded set of labels: each path's is kept once
    found, for up to `size` paths."""

    def __init__(self, routes: Sequence[BaseRoute], size: int = 4096) -> None:
        self.routes = [r for r in routes if isinstance(r, Route | Mount)]  # those with a template of their own
        self.size = size
        self.known: dict[str, str] = {}

    def __call__(self, scope: Scope) -> str:
        path = scope["path"]
        if (label := self.known.get(path)) is not None:
            return label
        template = next((r.path for r in self.routes if r.matches(scope)[0] != Match.NONE), "other")
        # a catch-all (V2's 404 in its own format) names no route of its own
        label = "other" if ":path}" in template else template.replace(VERSION_SEGMENT, "")
        if len(self.known) >= self.size:
            self.known.clear()
        self.known[path] = label
        return label


class RequestTelemetry:
    """Pure ASGI (not BaseHTTPMiddleware), so the route can still watch the connection for disconnects."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.route_label = RouteLabels(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if VALID_REQUEST_ID.fullmatch(incoming) else request_ids.next()
        scope.setdefault("state", {})["request_id"] = request_id
        route = self.route_label(scope)
        status = 499  # stays so when the client leaves before any response
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        in_flight = self.metrics.in_flight.labels("http", route)
        in_flight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # Starlette's outermost middleware answers it with a 500
            if status == 499:
                status = 500
            raise
        finally:
            seconds = time.perf_counter() - started
            in_flight.dec()
            self.metrics.requests.labels("http", route, str(status)).inc()
            self.metrics.latency.labels("http", route).observe(seconds)
            if not untraced(scope):
                client = scope.get("client")
                extra = {"request_id": request_id, "client": f"{client[0]}:{client[1]}" if client else "-"}
                traced = ""
                span = trace.get_current_span().get_span_context()
                if span.is_valid:  # tracing is on: the line names its trace and span
                    extra |= {"trace_id": f"{span.trace_id:032x}", "span_id": f"{span.span_id:016x}"}
                    traced = f" trace_id={extra['trace_id']} span_id={extra['span_id']}"
                log.info(
                    "%s %s %d %.1fms id=%s client=%s%s",
                    scope["method"],
                    scope["path"],
                    status,
                    seconds * 1e3,
                    request_id,
                    extra["client"],
                    traced,
                    extra=extra,
                )


class AcceptedRequests:
    """Each request accepted by the app's data plane (`DataPlane.accepted`) until answered: the drain waits for it,
    and one still running when the drain runs out is answered 503 (DRAIN_TIMED_OUT) in its route's protocol's
    format, with `Connection: close`, instead of being dropped."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        plane: DataPlane = scope["app"].state.data_plane  # read per request: it changes once the models are loaded
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        with plane.accepted():
            try:
                await self.app(scope, receive, send_noting_start)
            except asyncio.CancelledError:
                if not plane.cut_here():
                    raise
                if not started:
                    error = plane.cut_error()
                    response = protocol_of(Request(scope)).response(503, error.detail, {"Connection": "close"})
                    await response(scope, receive, send)
