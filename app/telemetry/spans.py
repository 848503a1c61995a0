"""The core's spans, through OpenTelemetry's API only: no-ops until a tracer provider is installed
(`app.telemetry.tracing`, when an OTLP endpoint is configured).

Under a request's span (the edge's), the core adds `infer` (one model's call: its images, model
version, backend and device), `admission`, `decode` (one per image), `queue` (until the batch that
computes the request's last image starts) and `encode`. Each forward pass is a `batch` span of its own,
linked to the span of every request whose images rode in it: how a slow request is explained by its
batch. Across serving processes the context travels with the call (W3C trace context).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanContext
from opentelemetry.util.types import AttributeValue

tracer = trace.get_tracer("vit-serve")
recording = False  # whether a tracer provider is installed (`app.telemetry.tracing`): none is recorded before


def start_recording() -> None:
    """Spans are recorded from now on: a tracer provider has been installed."""
    global recording
    recording = True


def current_span_context() -> SpanContext | None:
    """The sampled span under way here, for a batch to link to; None outside any, with tracing off, or
    when sampling left this request out (a batch of such requests makes no span)."""
    if not recording:
        return None
    context = trace.get_current_span().get_span_context()
    return context if context.is_valid and context.trace_flags.sampled else None


def child_span(
    name: str, attributes: Mapping[str, AttributeValue] | None = None, context: otel_context.Context | None = None
) -> AbstractContextManager[object]:
    """A span under the current one (or under `context`'s), current while the block runs. None at all
    under a parent that is not sampled (tracing off, or a request that sampling left out): the block then
    costs a context lookup rather than the API's no-op span. The parent may be remote: a front-end's span,
    sent along to the engine process."""
    if not sampled(context):
        return NO_SPAN
    return tracer.start_as_current_span(name, context=context, attributes=attributes)


NO_SPAN = nullcontext()


def sampled(context: otel_context.Context | None = None) -> bool:
    """Whether the span under way here (or `context`'s, local or remote) is sampled: the one test before any
    of the core's spans is made; at once False while no tracer provider is installed (it runs several times for
    every request)."""
    return recording and trace.get_current_span(context).get_span_context().trace_flags.sampled


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() instant on the wall clock spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def record_span(
    name: str, started: float, ended: float, attributes: Mapping[str, AttributeValue] | None = None
) -> None:
    """A span, under the current one, of something timed already (time.monotonic() instants)."""
    if not sampled():
        return
    span = tracer.start_span(name, start_time=wall_ns(started), attributes=attributes)
    span.end(end_time=wall_ns(ended))


def batch_links(contexts: list[SpanContext | None]) -> list[Link]:
    seen: dict[tuple[int, int], SpanContext] = {}
    for c in contexts:
        if c is not None:
            seen.setdefault((c.trace_id, c.span_id), c)
    return [Link(c) for c in seen.values()]


ROOT = otel_context.Context()  # no parent: a batch starts a trace of its own


def carrier() -> dict[str, str]:
    """The current trace context as W3C headers, to send along to the engine process."""
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


def attach(headers: Mapping[str, str] | None) -> object | None:
    """Make the context `carrier` sent the current one (a token for `detach`); None without one."""
    if not headers:
        return None
    return otel_context.attach(propagate.extract(dict(headers)))


def sent_sampled(headers: Mapping[str, str] | None) -> bool:
    """Whether the context `carrier` sent is a sampled span's: only such a request gets the engine's spans (and
    its batch's link); one that sampling left out is computed as an untraced one."""
    if not headers or not recording:  # (before the headers are parsed: nothing to extract while tracing is off)
        return False
    return sampled(propagate.extract(dict(headers)))


def detach(token: object | None) -> None:
    if token is not None:
        otel_context.detach(token)  # type: ignore[arg-type]
