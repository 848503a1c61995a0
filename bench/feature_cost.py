"""What each optional feature costs a request: its calls timed in process with the service's own code.

    python -m bench feature-cost --requests 20000

An A/B of two servers cannot resolve shares this small on a shared machine (its rounds move by 5 to 20 %), so
each feature's calls for one request are timed directly, with the service's own classes, in CPU time on one
thread (the best of `--repeats` runs), and set beside the server's CPU per request in
bench/results/cache-cpu.json (`python -m bench.cache`: cache off for a computed request, on for a hit):
- statistics (Triton's statistics extension, always on): a computed request, with its share of a batch of
  `--batch` (`request_timing`, `answered`, the four durations, `batch_done` less its Prometheus half), and a
  request answered from the response cache;
- monitoring: out-of-distribution scores and the drift gauges (`Watching`, the batcher's observer) with a
  shadow pair at fraction 0, on the bundled checkpoint, one image a request, its share of a batch;
- tracing off: a request's tracing calls with no tracer provider (app/telemetry/spans.py, the access line);
- tracing on, per span, the core's five spans of a request with their attributes (OpenTelemetry's SDK, as
  app.telemetry.tracing installs it): made and ended with no span processor; encoded to OTLP protobuf as the
  exporters do, one thread; both as the service runs them, the BatchSpanProcessor encoding on its own thread (the
  process's CPU; the main thread's beside it);
- the JPEG header: a plain JPEG told for the GPU from its markers (`plain_jpeg`), against PIL's check (the header
  opened, then `gpu_decodable`), for the benchmarks' 500x375 JPEG and the same with an EXIF block.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.common import RESULTS, write_results
from harness.images import photo_jpeg
from harness.records import cpu_model, table

SPANS_PER_REQUEST = 5
MODEL, VERSION = "vit-shapes", "1191dfd418c5"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.feature_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000, help="requests (or files) timed in each run")
    p.add_argument("--batch", type=int, default=8, help="requests per batch (one image each)")
    p.add_argument("--repeats", type=int, default=5, help="the best of this many runs is reported")
    p.add_argument("--name", default="feature-cost-cpu")
    return p.parse_args()


def cpu_us(run: Callable[[], None], count: int) -> float:
    began = time.process_time()
    run()
    return (time.process_time() - began) / count * 1e6


def statistics_computed(requests: int, batch: int) -> float:
    from app.core.engine.timing import request_timing
    from app.telemetry.metrics import Metrics, ModelMetrics
    from app.telemetry.statistics import BatchTiming, StatisticsBook

    class Output:  # what the predictor hands back per image, as far as the statistics read it
        def __init__(self, timing: BatchTiming) -> None:
            self.batch = timing

    book = StatisticsBook()
    observer = ModelMetrics(Metrics(), MODEL, book)
    observer.bind_version(VERSION)
    metrics_only = ModelMetrics(Metrics(), MODEL)  # the /metrics half of batch_done, subtracted

    def with_statistics() -> None:
        outputs: list[Any] = []
        for i in range(requests):
            started = time.monotonic()
            if i % batch == 0:
                outputs = [Output(BatchTiming(batch, started, 1e-4, 2e-3, 1e-4))]
                observer.batch_done(batch, 2.2e-3, outputs)
            stats = book.of(MODEL, VERSION)
            done = request_timing(started, started + 1e-3, started + 3e-3, started + 3.1e-3, outputs)
            stats.answered(1, 3.1e-3)
            for part in ("queue", "compute_input", "compute_infer", "compute_output"):
                getattr(stats, part).add(getattr(done, part))

    def metrics_alone() -> None:
        for _ in range(0, requests, batch):
            timing = BatchTiming(batch, time.monotonic(), 1e-4, 2e-3, 1e-4)
            metrics_only.batch_done(batch, 2.2e-3, [Output(timing)])

    return cpu_us(with_statistics, requests) - cpu_us(metrics_alone, requests)


def statistics_hit(requests: int) -> float:
    from app.telemetry.statistics import StatisticsBook

    book = StatisticsBook()

    def hits() -> None:
        for _ in range(requests):
            stats = book.of(MODEL, VERSION)
            stats.cache_hit.add(2e-5, count=1)
            stats.cache_miss.add(0.0, count=0)
            stats.answered(1, 3e-5)

    return cpu_us(hits, requests)


def monitoring(requests: int, batch: int) -> Callable[[], float]:
    """The bundled checkpoint served twice (a shadow pair at fraction 0), its drift window on; a run's timing."""
    from app.core.backends.predictor import ImageInput, ImageOutput, embeddings_asked
    from app.core.engine.drift import Watching
    from app.core.engine.engine import Engine
    from app.settings import BUNDLED_WEIGHTS, Settings

    models = f"a={BUNDLED_WEIGHTS},b={BUNDLED_WEIGHTS}"
    settings = Settings(models=models, shadow="a:b:0", ood_threshold="0.5", device="cpu", backend="torch", warmup=False)
    engine = Engine.load(settings)
    model = engine.served["a"]
    watching = model.batcher.observer
    assert isinstance(watching, Watching) and model.checkpoint.reference is not None
    g = torch.Generator().manual_seed(0)
    embedding = torch.randn(batch, model.checkpoint.config.dim, generator=g)  # a batch's embeddings, as computed
    probabilities = torch.randn(batch, len(model.classes), generator=g).softmax(-1)
    items = [ImageInput(torch.empty(0), "none", None, True) for _ in range(batch)]

    def monitored() -> None:
        rows: list[Any] = []
        for i in range(requests):
            j = i % batch
            if j == 0:  # the batch's images into the window, as the batcher's observer takes them
                rows = embeddings_asked(embedding, items)
                watching.watch.add([ImageOutput(probabilities[k], None, rows[k]) for k in range(batch)])
            _ = [ImageOutput(probabilities[j], None, rows[j])]  # the request's outputs, made as below
            if engine.shadowing.sampling(model.name) is not None:
                raise AssertionError("fraction 0: never shadowed")

    def bare() -> None:  # the same loop's own cost: the outputs made, nothing monitored
        for i in range(requests):
            _ = [ImageOutput(probabilities[i % batch], None, None)]

    return lambda: cpu_us(monitored, requests) - cpu_us(bare, requests)


def tracing_off(requests: int) -> float:
    """Run before any tracer provider exists: the core's spans skipped and recorded, a batch link, the access
    line's check."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    from app.telemetry import spans as core

    infer = {"vit.model.name": MODEL, "vit.images": 1}

    def calls() -> None:
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

    return cpu_us(calls, requests)


def spans(requests: int) -> dict[str, float]:
    """µs per span: made and ended, encoded, and both as the service runs them."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.trace import Tracer

    class Exporter(SpanExporter):
        """Keeps each span, or encodes each batch as the OTLP exporters do before sending (and sends nothing)."""

        def __init__(self, encode: bool) -> None:
            self.encode, self.kept, self.encoded = encode, list[ReadableSpan](), 0

        def export(self, batch: Sequence[ReadableSpan]) -> SpanExportResult:
            if self.encode:
                encode_spans(batch).SerializeToString()
                self.encoded += len(batch)
            else:
                self.kept.extend(batch)
            return SpanExportResult.SUCCESS

    def requests_on(tracer: Tracer) -> None:
        for i in range(requests):
            now = time.time_ns()
            infer = {"vit.model.name": MODEL, "vit.model.version": VERSION, "vit.backend": "onnxruntime"}
            with tracer.start_as_current_span("infer", attributes=infer | {"vit.device": "cpu", "vit.images": 1}):
                tracer.start_span("admission", start_time=now, attributes={"vit.images": 1}).end(end_time=now + 1000)
                with tracer.start_as_current_span("decode", attributes={"vit.image.filename": f"{i}.png"}):
                    pass
                tracer.start_span("queue", start_time=now).end(end_time=now + 2000)
                with tracer.start_as_current_span("encode"):
                    pass

    count = requests * SPANS_PER_REQUEST
    made = cpu_us(lambda: requests_on(TracerProvider().get_tracer("vit-serve")), count)
    keeping, provider = Exporter(encode=False), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(keeping))
    requests_on(provider.get_tracer("vit-serve"))
    kept = keeping.kept
    encoded = cpu_us(
        lambda: [encode_spans(kept[at : at + 512]).SerializeToString() for at in range(0, count, 512)], count
    )
    encoding, provider = Exporter(encode=True), TracerProvider()
    # app.telemetry.tracing's processor, with a queue that holds every span (this loop makes them far faster than
    # a server's requests do, and the default queue would drop some instead of encoding them)
    provider.add_span_processor(BatchSpanProcessor(encoding, max_queue_size=max(count, 512)))
    thread = time.thread_time()
    both = cpu_us(lambda: (requests_on(provider.get_tracer("vit-serve")), provider.shutdown()), count)
    assert encoding.encoded == count, "every span encoded, none dropped"
    return {
        "made": made,
        "encoded": encoded,
        "both": both,
        "both_main_thread": (time.thread_time() - thread) / count * 1e6,
    }


def jpeg_header(requests: int) -> dict[str, float]:
    from PIL import Image

    from app.core.images.decode import open_image
    from app.core.images.gpu_decode import gpu_decodable
    from app.core.images.jpeg_markers import plain_jpeg

    plain = photo_jpeg(0)
    image, exif = Image.open(io.BytesIO(plain)), Image.Exif()
    exif[0x0112], exif[0x010F] = 1, "a camera"  # upright, and a camera's name
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90, exif=exif.tobytes())
    checks: dict[str, Callable[[bytes], bool]] = {
        "markers": lambda d: plain_jpeg(d, 10**8),
        "PIL": lambda d: gpu_decodable(open_image(d, "x.jpg", 10**8), d),
    }
    figures = {}
    for file, data in (("plain", plain), ("exif", buf.getvalue())):
        for name, check in checks.items():
            assert check(data)
            figures[f"{name}_{file}"] = cpu_us(lambda c=check, d=data: [c(d) for _ in range(requests)], requests)
    return figures


def server_cpu_us() -> dict[str, float]:
    """The server's CPU per /predict request from the last `bench.cache` run: cache off and on (medians)."""
    path = RESULTS / "cache-cpu.json"
    if not path.exists():
        return {}
    runs = json.loads(path.read_text())["runs"]
    off = [r["predict_cpu_us"] for r in runs if r["cache_bytes"] == 0]
    on = [r["predict_cpu_us"] for r in runs if r["cache_bytes"] > 0]
    return {"computed": statistics.median(off), "hit": statistics.median(on)} if off and on else {}


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: min(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    n, repeats = args.requests, range(args.repeats)
    figures = {"tracing_off": min(tracing_off(n) for _ in repeats)}  # first: before any tracer provider exists
    figures["statistics_computed"] = min(statistics_computed(n, args.batch) for _ in repeats)
    figures["statistics_hit"] = min(statistics_hit(n) for _ in repeats)
    monitored = monitoring(n, args.batch)
    figures["monitoring"] = min(monitored() for _ in repeats)
    figures |= {f"span_{k}": v for k, v in best([spans(n) for _ in repeats]).items()}
    figures |= {f"header_{k}": v for k, v in best([jpeg_header(n) for _ in repeats]).items()}
    report = {
        "requests": n,
        "batch": args.batch,
        "repeats": args.repeats,
        "us": figures,
        "server_cpu_us": server_cpu_us(),
    }
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    us, server = report["us"], report["server_cpu_us"]

    def share(value: float, of: str) -> str:
        return f"{value / server[of] * 100:.2f} % of {server[of]:,.0f} µs" if server else "(no bench.cache results)"

    spans = SPANS_PER_REQUEST
    rows = [
        [
            "statistics",
            "a computed request",
            f"{us['statistics_computed']:.2f}",
            share(us["statistics_computed"], "computed"),
        ],
        [
            "statistics",
            "a request answered from the cache",
            f"{us['statistics_hit']:.2f}",
            share(us["statistics_hit"], "hit"),
        ],
        [
            "OOD scores, drift gauges, shadow at 0",
            "a computed request",
            f"{us['monitoring']:.1f}",
            share(us["monitoring"], "computed"),
        ],
        ["tracing off", "a request's tracing calls", f"{us['tracing_off']:.1f}", share(us["tracing_off"], "computed")],
    ]
    for key, what in (("made", "made and ended, no processor"), ("encoded", "encoded to OTLP, one thread")):
        rows.append([f"tracing on: {what}", f"a span ({spans} a request)", f"{us[f'span_{key}']:.1f}", ""])
    rows.append(["tracing on: both, BatchSpanProcessor", "a span: the process", f"{us['span_both']:.1f}", ""])
    rows.append(
        [
            "tracing on: both, BatchSpanProcessor",
            "a span: the thread making it",
            f"{us['span_both_main_thread']:.1f}",
            "",
        ]
    )
    for file, label in (("plain", "a 500x375 JPEG"), ("exif", "the same with EXIF")):
        for check in ("markers", "PIL"):
            what = "`plain_jpeg` (markers)" if check == "markers" else "PIL's check (`open_image`, `gpu_decodable`)"
            rows.append([f"JPEG header: {what}", label, f"{us[f'header_{check}_{file}']:.1f}", ""])
    return "\n".join(
        [
            f"# What each optional feature costs a request ({cpu_model()})",
            "",
            f"`python -m bench feature-cost --requests {report['requests']}`: each feature's calls timed in process "
            f"with the service's own code, CPU time on one thread, the best of {report['repeats']} runs; batches of "
            f"{report['batch']}. The share is of the server's CPU per /predict request in "
            "`bench/results/cache-cpu.json` (`python -m bench.cache`, the median run: cache off for a computed "
            "request, on for a hit).",
            "",
            *table(["feature", "per", "µs of CPU", "share of a request"], rows),
            "",
        ]
    )


if __name__ == "__main__":
    main()
