"""A local OTLP trace receiver, over gRPC and HTTP (protobuf), for the tests and the benchmark: it keeps (or
only counts) the spans a server exports to it, as a collector would receive them."""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from harness.server import free_port


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    links: list[tuple[str, str]]  # (trace_id, span_id) of each link
    attributes: dict[str, Any]
    service: str
    status_code: int
    start_ns: int  # since the epoch
    end_ns: int


@dataclass
class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """`with Receiver() as r:` listens on `r.endpoint` (for OTEL_EXPORTER_OTLP_ENDPOINT with protocol grpc)
    and on `r.http_endpoint` (the same with http/protobuf, the specification's default: POST /v1/traces)."""

    keep: bool = True  # False: count the spans only
    spans: list[ReceivedSpan] = field(default_factory=list)
    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        if self.keep:
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        else:  # counting only: the exports' bytes are not even parsed, so the receiver costs next to nothing
            handler = grpc.unary_unary_rpc_method_handler(self.export_bytes, response_serializer=lambda _: b"")
            service = grpc.method_handlers_generic_handler(
                "opentelemetry.proto.collector.trace.v1.TraceService", {"Export": handler}
            )
            self.server.add_generic_rpc_handlers((service,))
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), http_handler(self))
        self.http_endpoint = f"http://127.0.0.1:{self.http.server_address[1]}"

    def export_bytes(self, request: bytes, context: Any) -> None:
        with self.lock:
            self.count += 1  # exports (batches of spans), not spans: they are not parsed

    def __enter__(self) -> Receiver:
        self.server.start()
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)
        self.http.shutdown()
        self.http.server_close()

    def Export(self, request: Any, context: Any) -> Any:
        received = []
        for resource_spans in request.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), ""
            )
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            attributes={a.key: value(a.value) for a in s.attributes},
                            service=service,
                            status_code=s.status.code,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        with self.lock:
            self.count += len(received)
            if self.keep:
                self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.name == name]


def http_handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            if receiver.keep:
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                answer = receiver.Export(request, None).SerializeToString()
            else:
                receiver.export_bytes(body, None)
                answer = b""
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
