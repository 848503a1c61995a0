"""OpenTelemetry traces from real servers to a local OTLP receiver (over HTTP, the default protocol, and
gRPC): configured by OpenTelemetry's own variables, one span per HTTP and gRPC request continuing the
caller's traceparent, the core's spans under it (also from the engine process of VIT_WORKERS=2, its
front-ends decoding the images), each forward pass a span linked to its requests (concurrent requests
that share a batch, over HTTP and gRPC, link to the same one), the trace IDs on the access lines, and one
trace per batch-runner run."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from app.codecs.proto.service_pb2_grpc import GRPCInferenceServiceStub
from app.core.contract.description import numeric_version
from app.settings import BUNDLED_WEIGHTS
from app.telemetry.tracing import tracing_configured
from harness.images import encode
from harness.otlp import ReceivedSpan, Receiver
from harness.preloaded import run_command
from harness.server import ROOT, Server
from model.checkpoint import load_checkpoint
from model.shapes import make_sample
from tests.support.checkpoints import heavy_checkpoint
from tests.support.grpc_requests import image_request

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
PNG = encode(make_sample(3, 2).image)
TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
UNSAMPLED = "5b8efff798038103d269b633813fc60c"
VERSION = numeric_version(load_checkpoint(BUNDLED_WEIGHTS).content_hash)


def otel_env(receiver: Receiver, protocol: str = "grpc") -> dict[str, str]:
    """OTLP over `protocol`: grpc, or http/protobuf, the default when OTEL_EXPORTER_OTLP_PROTOCOL is unset."""
    grpc_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    return {
        **(grpc_env if protocol == "grpc" else {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint}),
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export every 100 ms
        "OTEL_SERVICE_NAME": "vit-test",
    }


def test_tracing_is_on_only_with_an_otlp_endpoint() -> None:
    assert not tracing_configured({})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": " "})


def wait_for(receiver: Receiver, condition: object, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, [(s.name, s.trace_id) for s in receiver.spans]
        time.sleep(0.05)


def one(spans: list[ReceivedSpan]) -> ReceivedSpan:
    assert len(spans) == 1, spans
    return spans[0]


@pytest.mark.parametrize(("workers", "protocol"), [("1", "http/protobuf"), ("2", "grpc")])
def test_a_request_continues_its_trace_with_the_cores_spans(workers: str, protocol: str) -> None:
    with Receiver() as receiver:
        # A sampler that starts no trace of its own: what is traced is what the caller sampled, and the
        # forward pass's `batch` span (a new trace) is kept because a sampled request rode in it.
        sampling = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
        env = {**otel_env(receiver, protocol), **sampling, "VIT_LOG_FORMAT": "json", "VIT_WORKERS": workers}
        with Server(BUNDLED_WEIGHTS, **env) as server:
            files = [("files", (f"{i}.png", PNG, "image/png")) for i in range(2)]
            unsampled = {"traceparent": f"00-{UNSAMPLED}-{PARENT}-00"}
            assert httpx.post(server.url + "/predict", files=files, headers=unsampled).status_code == 200
            headers = {"traceparent": f"00-{TRACE}-{PARENT}-01"}
            assert httpx.post(server.url + "/predict", files=files, headers=headers).status_code == 200
            assert httpx.get(server.url + "/health/ready").status_code == 200  # probes: no trace

            def traced(name: str) -> list[ReceivedSpan]:
                return [s for s in receiver.named(name) if s.trace_id == TRACE]

            def requests() -> list[ReceivedSpan]:  # it ends after the answer: maybe in a later export
                return [s for s in receiver.spans if s.trace_id == TRACE and s.parent_span_id == PARENT]

            wait_for(receiver, lambda: traced("encode") and traced("infer") and receiver.named("batch") and requests())
            request = one(requests())
            assert request.name == "POST /predict" and request.attributes["http.response.status_code"] == 200
            assert request.attributes["http.route"] == "/predict"
            names = {s.name for s in receiver.spans if s.trace_id == TRACE}  # one span per request: no more
            assert names == {"POST /predict", "infer", "admission", "decode", "queue", "encode"}, names
            assert request.service == "vit-test"
            infer = one(traced("infer"))
            assert infer.parent_span_id == request.span_id  # across the processes with VIT_WORKERS=2
            assert infer.attributes == {
                "vit.model.name": "vit-shapes",
                "vit.model.version": VERSION,
                "vit.backend": "onnxruntime",
                "vit.device": "cpu",
                "vit.images": 2,
            }
            decodes = traced("decode")
            assert sorted(s.attributes["vit.image.filename"] for s in decodes) == ["0.png", "1.png"]
            for name in ("admission", "queue"):
                assert one(traced(name)).parent_span_id == infer.span_id
            # One process decodes inside `infer`; with VIT_WORKERS=2 the front-end decodes, before the engine's `infer`.
            decoded_under = infer if workers == "1" else request
            assert all(s.parent_span_id == decoded_under.span_id for s in decodes)
            if workers == "2":
                assert max(s.end_ns for s in decodes) <= infer.start_ns
            assert one(traced("encode")).parent_span_id == request.span_id
            [batch] = [b for b in receiver.named("batch") if (TRACE, infer.span_id) in b.links]
            assert batch.trace_id != TRACE and batch.parent_span_id == ""  # a trace of its own, linked
            assert batch.attributes["vit.batch_size"] == 2 and batch.attributes["vit.model.version"] == VERSION
            assert not [s for s in receiver.spans if "health" in s.name or s.name.endswith((" receive", " send"))]
            # Nothing of the request its caller did not sample, nor of a batch that only it rode in.
            assert {s.trace_id for s in receiver.spans} == {TRACE, batch.trace_id}, receiver.spans
            assert receiver.named("batch") == [batch]
            out = server.stop()
    lines = [json.loads(line) for line in out.splitlines() if '"app.access"' in line and "/predict" in line]
    assert [line["trace_id"] for line in lines] == [UNSAMPLED, TRACE]  # an unsampled request's line too
    assert lines[1]["span_id"] == request.span_id


def test_a_grpc_call_continues_its_trace() -> None:
    with Receiver() as receiver, Server(BUNDLED_WEIGHTS, **otel_env(receiver)) as server:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = GRPCInferenceServiceStub(channel)
            metadata = (("traceparent", f"00-{TRACE}-{PARENT}-01"),)
            stub.ModelInfer(image_request(PNG, model="vit-shapes"), metadata=metadata)
        # the call's span ends after its answer is sent: it may come in a later export than `infer`
        wait_for(
            receiver,
            lambda: (
                [s for s in receiver.named("infer") if s.trace_id == TRACE]
                and [s for s in receiver.spans if s.trace_id == TRACE and s.parent_span_id == PARENT]
            ),
        )
        call = one([s for s in receiver.spans if s.trace_id == TRACE and s.parent_span_id == PARENT])
        assert call.name == "/inference.GRPCInferenceService/ModelInfer"
        assert call.attributes["rpc.grpc.status_code"] == 0
        assert one([s for s in receiver.named("infer") if s.trace_id == TRACE]).parent_span_id == call.span_id


@pytest.mark.parametrize("edge", ["http", "grpc"])
def test_concurrent_requests_that_share_a_batch_link_to_its_span(edge: str, tmp_path: Path) -> None:
    """16 requests at once: one thread's forward pass of the heavy model outlasts the handling of a request, so
    while one batch computes the others queue and share the next. Whether they do depends on the machine's other
    load (with its cores taken, the requests can reach the server a forward apart), so three bursts are sent, each
    released at once by a barrier, and one of them must share a batch; every burst's spans are checked."""
    heavy = heavy_checkpoint(tmp_path / "vit-shapes.safetensors")
    env = {**otel_env(receiver := Receiver()), "VIT_MAX_WAIT_MS": "50", "VIT_THREADS": "1", "VIT_BACKEND": "torch"}
    with receiver, Server(heavy, **env) as server, grpc.insecure_channel(server.grpc_target) as channel:
        stub = GRPCInferenceServiceStub(channel)

        def burst(traces: list[str]) -> int:
            """One request per trace, all at once; the most requests one batch's span links to."""
            start = threading.Barrier(len(traces))

            def send(trace: str) -> None:
                traceparent = f"00-{trace}-{PARENT}-01"
                start.wait()  # while one batch computes, the rest queue
                if edge == "grpc":
                    stub.ModelInfer(image_request(PNG, model="vit-shapes"), metadata=(("traceparent", traceparent),))
                else:
                    files = {"file": ("a.png", PNG, "image/png")}
                    r = httpx.post(server.url + "/predict", files=files, headers={"traceparent": traceparent})
                    assert r.status_code == 200, r.text

            with ThreadPoolExecutor(len(traces)) as pool:
                list(pool.map(send, traces))

            def infers() -> dict[str, ReceivedSpan]:
                return {s.trace_id: s for s in receiver.named("infer") if s.trace_id in traces}

            def linking(infer: ReceivedSpan) -> list[ReceivedSpan]:
                return [b for b in receiver.named("batch") if (infer.trace_id, infer.span_id) in b.links]

            wait_for(receiver, lambda: len(infers()) == len(traces) and all(linking(i) for i in infers().values()))
            batches = {}
            for infer in infers().values():
                (batch,) = linking(infer)  # exactly one forward pass computed its image
                batches[batch.span_id] = batch
            assert all(b.attributes["vit.batch_size"] == len(b.links) for b in batches.values())  # only ours rode
            return max(len(b.links) for b in batches.values())

        shared = [burst([f"{n * 16 + i + 1:032x}" for i in range(16)]) for n in range(3)]  # each one image
    assert max(shared) > 1  # requests shared a batch: one span, linked to each


def test_the_batch_runner_traces_one_run(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        (images / f"{i}.png").write_bytes(encode(make_sample(40, i).image))
    with Receiver() as receiver:
        argv = [
            sys.executable,
            "-m",
            "app.batch",
            str(images),
            "--output",
            str(tmp_path / "rows.jsonl"),
            "--device",
            "cpu",
        ]
        env = {**os.environ, **otel_env(receiver)}
        done = run_command(argv, cwd=ROOT, env=env, check=False)
        assert done.returncode == 0, done.stderr
        run = one(receiver.named("batch run"))
        assert run.parent_span_id == "" and run.attributes["vit.files"] == 3
        infers = [s for s in receiver.named("infer") if s.trace_id == run.trace_id]
        assert len(infers) == 3 and all(s.parent_span_id == run.span_id for s in infers)
        linked = {span for b in receiver.named("batch") for trace, span in b.links if trace == run.trace_id}
        assert linked == {s.span_id for s in infers}  # every image's request rode in a linked batch
