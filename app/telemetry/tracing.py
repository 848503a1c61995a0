"""OpenTelemetry traces, configured the standard way: on when an OTLP endpoint is set.

`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns tracing on, unless
`OTEL_SDK_DISABLED=true`. The SDK reads the rest itself: `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`
(`http/protobuf`, the specification's default, or `grpc`), `OTEL_SERVICE_NAME` (here `vit-serve` when unset),
`OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`, `OTEL_BSP_*` for the batching of exports.

With none of them set nothing here is imported beyond the API, whose tracer is a no-op: the core's spans
(`app.telemetry.spans`) cost a function call. When on, the HTTP edge (FastAPI's native instrumentation,
`app.web.middleware.http_telemetry`) and the gRPC edge (grpcio's server interceptor) start one span per
request, continuing an incoming W3C `traceparent`; the core adds its spans under it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace

from app.telemetry.spans import start_recording

log = logging.getLogger("app")
DEFAULT_SERVICE_NAME = "vit-serve"


def tracing_configured(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces: an OTLP endpoint, and the SDK not disabled."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    )


def span_exporter(env: Mapping[str, str] = os.environ) -> Any:
    """The OTLP exporter of the configured protocol; it reads its endpoint, headers and timeout itself."""
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be grpc or http/protobuf, got {protocol!r}")


def configure_tracing(env: Mapping[str, str] = os.environ) -> bool:
    """Install the SDK's tracer provider, exporting over OTLP, when the environment asks; whether it did."""
    if not tracing_configured(env):
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from app.telemetry.sampler import BatchesOfSampledRequests

    exporter = span_exporter(env)
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: DEFAULT_SERVICE_NAME}
    configured = TracerProvider(shutdown_on_exit=False).sampler  # the SDK's reading of OTEL_TRACES_SAMPLER
    provider = TracerProvider(resource=Resource.create(attributes), sampler=BatchesOfSampledRequests(configured))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    start_recording()
    log.info("tracing: spans exported over OTLP (%s)", type(exporter).__module__.rsplit(".", 2)[-2])
    return True


def shutdown_tracing() -> None:
    """Export the spans still buffered (at exit)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def grpc_interceptors() -> list[Any]:
    """A server span per gRPC call (grpcio's instrumentation), when tracing is configured."""
    if not tracing_configured():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]
