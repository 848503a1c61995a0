"""What the OpenTelemetry SDK costs a traced request, outside the service: the floor under tracing's cost.

    python -m bench.compare.span_cost --requests 20000

Each simulated request makes the core's spans with the core's attributes (`infer`, `admission`, `decode`,
`queue`, `encode`; app/telemetry/spans.py) through the SDK the service installs (`app.telemetry.tracing`). Three
measurements, each in CPU time per span:
- created and ended, the tracer provider with no span processor;
- encoded to OTLP protobuf by the encoder the OTLP exporters use (`encode_spans`, then serialized),
  one thread;
- both, as the service runs them: the `BatchSpanProcessor` with an exporter that encodes each batch
  as the OTLP exporter does (and sends nothing), the spans made on the main thread and encoded on the
  processor's. The process's CPU time over the spans made, and the main thread's own share.

And, before any of those, what a request's tracing calls cost with tracing off.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer

from app.telemetry import spans as core
from bench.common import write_results
from harness.records import cpu_model, table

SPANS_PER_REQUEST = 5


class Encoding(SpanExporter):
    """Encodes each batch as the OTLP exporters do before sending it; keeps nothing."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode_spans(spans).SerializeToString()
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class Keeping(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def request(tracer: Tracer, i: int) -> None:
    """One request's core spans, with the attributes the core gives them."""
    now = time.time_ns()
    infer = {
        "vit.model.name": "vit-shapes",
        "vit.model.version": "1191dfd418c5",
        "vit.backend": "onnxruntime",
        "vit.device": "cpu",
        "vit.images": 1,
    }
    with tracer.start_as_current_span("infer", attributes=infer):
        tracer.start_span("admission", start_time=now, attributes={"vit.images": 1}).end(end_time=now + 1000)
        with tracer.start_as_current_span(
            "decode", attributes={"vit.image.filename": f"{i}.png", "vit.image.bytes": 9000}
        ):
            pass
        tracer.start_span("queue", start_time=now, attributes=None).end(end_time=now + 2000)
        with tracer.start_as_current_span("encode"):
            pass


def off(requests: int) -> float:
    """CPU time of one request's tracing calls with tracing off, no tracer provider installed: the core's
    (app.telemetry.spans, as the engine, the preparer and the batcher make them) and the access line's."""
    infer = {"vit.model.name": "vit-shapes", "vit.images": 1}
    started = time.process_time()
    for i in range(requests):
        context = otel_context.get_current()  # handed to the pool thread that decodes
        with core.child_span("infer", infer):
            core.record_span("admission", 0.0, 0.0, {"vit.images": 1})
            with core.child_span("decode", {"vit.image.filename": f"{i}.png"}, context):
                pass
            core.current_span_context()  # what a batch would link to
            core.record_span("queue", 0.0, 0.0)
        with core.child_span("encode"):
            pass
        trace.get_current_span().get_span_context().is_valid  # noqa: B018 (the access line's check)
    return (time.process_time() - started) / requests * 1e6


def created(requests: int) -> float:
    tracer = TracerProvider().get_tracer("vit-serve")
    started = time.process_time()
    for i in range(requests):
        request(tracer, i)
    return (time.process_time() - started) / (requests * SPANS_PER_REQUEST) * 1e6


def encoded(requests: int) -> float:
    keeping = Keeping()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(keeping))  # each span handed over as it ends
    tracer = provider.get_tracer("vit-serve")
    for i in range(requests):
        request(tracer, i)
    spans = keeping.spans
    started = time.process_time()
    for at in range(0, len(spans), 512):  # the BatchSpanProcessor's default batch
        encode_spans(spans[at : at + 512]).SerializeToString()
    return (time.process_time() - started) / len(spans) * 1e6


def batched(requests: int) -> dict[str, float]:
    encoding = Encoding()
    provider = TracerProvider()
    # app.telemetry.tracing's processor, with a queue that holds every span: this loop makes spans far faster than a
    # server's requests do, and the default queue (2,048 spans) would drop some instead of encoding them
    provider.add_span_processor(BatchSpanProcessor(encoding, max_queue_size=requests * SPANS_PER_REQUEST))
    tracer = provider.get_tracer("vit-serve")
    process, thread, wall = time.process_time(), time.thread_time(), time.perf_counter()
    for i in range(requests):
        request(tracer, i)
    provider.shutdown()  # what is still queued is encoded
    spans = requests * SPANS_PER_REQUEST
    return {
        "process_cpu_us": (time.process_time() - process) / spans * 1e6,
        "main_thread_cpu_us": (time.thread_time() - thread) / spans * 1e6,
        "wall_us": (time.perf_counter() - wall) / spans * 1e6,
        "encoded": encoding.spans,
        "dropped": spans - encoding.spans,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.compare.span_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--name", default="span-cost-cpu")
    args = p.parse_args()
    report: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "requests": args.requests,
        "spans_per_request": SPANS_PER_REQUEST,
        "off_us_per_request": off(args.requests),  # first: before any provider exists
        "created_us": created(args.requests),
        "encoded_us": encoded(args.requests),
        "batched": batched(args.requests),
    }
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    b = report["batched"]
    rows = [
        ["created and ended, no span processor", f"{report['created_us']:.1f}"],
        ["encoded to OTLP protobuf and serialized, one thread", f"{report['encoded_us']:.1f}"],
        ["both, BatchSpanProcessor encoding on its thread: the whole process", f"{b['process_cpu_us']:.1f}"],
        ["both: the thread that makes the spans", f"{b['main_thread_cpu_us']:.1f}"],
        ["both: wall time of the thread that makes the spans", f"{b['wall_us']:.1f}"],
    ]
    return "\n".join(
        [
            f"# What the OpenTelemetry SDK costs a span ({report['cpu_count']} cores)",
            "",
            f"`python -m bench.compare.span_cost --requests {report['requests']}`: each request makes the core's "
            f"{report['spans_per_request']} spans with the core's attributes; CPU time per span. With the "
            f"BatchSpanProcessor (batches of 512, a queue that holds them all), {b['encoded']:,} spans were "
            f"encoded and {b['dropped']:,} dropped. On {report['cpu']}.",
            "",
            *table(["", "µs per span"], rows),
            "",
            f"With tracing off (no tracer provider), one request's tracing calls (the core's three spans "
            f"skipped, two recorded spans, a batch link and the access line's check) cost "
            f"{report['off_us_per_request']:.1f} µs of CPU in all.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
