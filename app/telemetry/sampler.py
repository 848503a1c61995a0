"""Sampling that keeps a forward pass's span with the requests that rode in it (imported only when tracing
is on: it needs the SDK)."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, TraceState
from opentelemetry.util.types import Attributes


class BatchesOfSampledRequests(Sampler):
    """The configured sampler, except for a span without a parent that links to a sampled span: that one
    is sampled. A forward pass's `batch` span starts a trace of its own, linked to the requests that rode
    in it (app.telemetry.spans), so a ratio sampler would keep it as seldom as any new trace; it is kept
    whenever one of those requests is, and only then (the core links sampled requests only)."""

    def __init__(self, configured: Sampler) -> None:
        self.configured = configured

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        parent = trace.get_current_span(parent_context).get_span_context()
        if not parent.is_valid and links and any(link.context.trace_flags.sampled for link in links):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self.configured.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"BatchesOfSampledRequests{{{self.configured.get_description()}}}"
