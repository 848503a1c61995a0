"""The sampler that keeps a forward pass's `batch` span with its sampled requests, wrapping the configured one."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBasedTraceIdRatio, Sampler
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, TraceFlags

from app.telemetry.sampler import BatchesOfSampledRequests
from app.telemetry.spans import ROOT


def context(trace_id: int, sampled: bool) -> SpanContext:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return SpanContext(trace_id, 0x1000 + trace_id, is_remote=False, trace_flags=flags)


def tracer(configured: Sampler) -> trace.Tracer:
    return TracerProvider(sampler=BatchesOfSampledRequests(configured), shutdown_on_exit=False).get_tracer("t")


def test_a_root_span_linked_to_a_sampled_request_is_sampled_whatever_the_ratio() -> None:
    t = tracer(ParentBasedTraceIdRatio(0.0))
    links = [Link(context(1, sampled=False)), Link(context(2, sampled=True))]
    span = t.start_span("batch", context=ROOT, links=links)
    assert span.is_recording() and span.get_span_context().trace_flags.sampled
    assert span.get_span_context().trace_id not in (1, 2)  # a trace of its own


def test_otherwise_the_configured_sampler_decides() -> None:
    t = tracer(ParentBasedTraceIdRatio(0.0))
    assert not t.start_span("batch", context=ROOT, links=[Link(context(1, sampled=False))]).is_recording()
    assert not t.start_span("request", context=ROOT).is_recording()
    assert tracer(ParentBasedTraceIdRatio(1.0)).start_span("request", context=ROOT).is_recording()
    # A child follows its parent, links or not: the wrapper decides for roots only.
    unsampled_parent = trace.set_span_in_context(NonRecordingSpan(context(3, sampled=False)))
    child = t.start_span("infer", context=unsampled_parent, links=[Link(context(2, sampled=True))])
    assert not child.is_recording()
    assert not tracer(ALWAYS_OFF).start_span("request", context=ROOT).is_recording()


def test_it_names_the_sampler_it_wraps() -> None:
    description = BatchesOfSampledRequests(ParentBasedTraceIdRatio(0.25)).get_description()
    assert description.startswith("BatchesOfSampledRequests{ParentBased{root:TraceIdRatioBased{0.25}")
