"""The Open Inference Protocol over gRPC: an edge over the data plane, on the HTTP server's event loop.

Each RPC converts its message with `app.codecs.v2_grpc`, calls the same data plane as V2 REST (same
models, batchers, limits, deadlines, API keys and metrics), and answers the core's errors with the
status codes of one table. Each RPC declares once whether it needs the engine serving and an API key.
Started and drained by the process's owner (`app.server`), beside the HTTP server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from app.codecs import v2_grpc
from app.codecs.model_config import model_config
from app.codecs.proto import messages_pb2 as pb
from app.codecs.shared_memory import cuda_status, system_status_message
from app.codecs.v2_metadata import (
    check_load_parameters,
    model_metadata,
    repository_index,
    server_metadata,
    statistics_response,
)
from app.codecs.v2_requests import Decoded, intake_for
from app.core.contract import errors
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.regions import CUDA_NOT_SUPPORTED
from app.core.data_plane import DataPlane
from app.telemetry.tracing import grpc_interceptors

log = logging.getLogger("app")
SERVICE = "inference.GRPCInferenceService"  # the RPCs' names on the wire: /inference.GRPCInferenceService/ModelInfer

Code = grpc.StatusCode
KEY_HINT = "send it in the x-api-key metadata, or as authorization: Bearer KEY"  # how gRPC carries an API key
STATUS: dict[type[errors.ServiceError], grpc.StatusCode] = {
    errors.PayloadTooLarge: Code.RESOURCE_EXHAUSTED,
    errors.UnsupportedMediaType: Code.INVALID_ARGUMENT,
    errors.InvalidInput: Code.INVALID_ARGUMENT,
    errors.Unauthorized: Code.UNAUTHENTICATED,
    errors.ModelNotFound: Code.NOT_FOUND,
    errors.Overloaded: Code.UNAVAILABLE,
    errors.NotReady: Code.UNAVAILABLE,
    errors.Draining: Code.UNAVAILABLE,
    errors.RequestTimeout: Code.DEADLINE_EXCEEDED,
    errors.InferenceFailed: Code.INTERNAL,
    errors.LoadFailed: Code.INVALID_ARGUMENT,
    errors.NotAllowed: Code.FAILED_PRECONDITION,
    errors.AlreadyExists: Code.ALREADY_EXISTS,
    errors.RegionNotFound: Code.NOT_FOUND,
    errors.NotSupported: Code.UNIMPLEMENTED,
}

Request = TypeVar("Request", bound=Message)
Response = TypeVar("Response", bound=Message)
Method = Callable[["InferenceServicer", Request, grpc.aio.ServicerContext], Awaitable[Response]]
Handler = Callable[["InferenceServicer", bytes, grpc.aio.ServicerContext], Awaitable[Response]]


def rpc(
    request_type: type[Request], *, serving: bool = False, authorized: bool = False
) -> Callable[[Method[Request, Response]], Handler[Response]]:
    """An RPC that parses its own request (bytes that are no such message: INVALID_ARGUMENT, not UNKNOWN) and
    answers the core's errors with status codes, counted and timed as HTTP requests are. With `serving`, it
    answers UNAVAILABLE until the models are loaded and once the engine has stopped (while the server drains
    it answers the calls it accepted and refuses new ones, `draining`); with `authorized`, it needs an API key
    (when VIT_API_KEYS is set). Each call is held as accepted by the data plane until answered."""

    def decorate(method: Method[Request, Response]) -> Handler[Response]:
        name = method.__name__

        async def handle(
            self: InferenceServicer, body: bytes, context: grpc.aio.ServicerContext, settle: Callable[[], None]
        ) -> Response:
            started = time.perf_counter()
            try:
                try:
                    request = request_type.FromString(body)
                except DecodeError:
                    raise errors.InvalidInput(
                        f"the request is not a valid {request_type.DESCRIPTOR.name} message"
                    ) from None
                if serving:
                    self.plane.check_serving()
                if authorized:
                    self.plane.authorize(credentials(context))
                response = await method(self, request, context)
            except errors.ServiceError as e:
                code = STATUS.get(type(e), Code.INTERNAL)
                detail = f"{e.detail}; {KEY_HINT}" if isinstance(e, errors.Unauthorized) else e.detail
                if e.retry_after_s is not None:
                    detail += f" (retry after {e.retry_after_s} s)"
                    context.set_trailing_metadata((("retry-after", str(e.retry_after_s)),))
            except grpc.aio.AbortError:
                raise
            except BaseException as e:  # cancelled (client gone, deadline, the drain's end) or a fault: never a crash
                if (
                    isinstance(e, asyncio.CancelledError) and self.plane.cut_here()
                ):  # still running when the drain ran out
                    code, detail = Code.UNAVAILABLE, self.plane.cut_error().detail
                elif not isinstance(e, Exception):
                    self.count(name, Code.CANCELLED, started)
                    raise
                else:
                    code, detail = Code.INTERNAL, "internal error; see the server log"
                    log.exception("unhandled error in gRPC %s", name)
            else:
                self.count(name, Code.OK, started)
                return response
            # counted before the status goes out (abort sends it at once): a client that has its answer
            # finds it in /metrics, and no longer in flight
            self.count(name, code, started)
            settle()
            await context.abort(code, detail)
            raise AssertionError("unreachable: abort raises")

        @functools.wraps(method)
        async def answer(self: InferenceServicer, body: bytes, context: grpc.aio.ServicerContext) -> Response:
            in_flight = self.plane.metrics.in_flight.labels("grpc", name)
            in_flight.inc()
            settled = False

            def settle() -> None:  # once, before the answer or the status goes out
                nonlocal settled
                if not settled:
                    settled = True
                    in_flight.dec()

            try:
                with self.plane.accepted():
                    return await handle(self, body, context, settle)
            finally:
                settle()

        answer.rpc = True  # type: ignore[attr-defined]
        return answer

    return decorate


def credentials(context: grpc.aio.ServicerContext) -> str:
    """The API key a call carries: metadata x-api-key, or authorization: Bearer KEY."""
    metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
    given = metadata.get("x-api-key") or metadata.get("authorization", "")
    return given.removeprefix("Bearer ").strip()


class InferenceServicer:
    """inference.GRPCInferenceService over one data plane: one method per RPC, named as the RPC."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def count(self, rpc_name: str, code: grpc.StatusCode, started: float) -> None:
        self.plane.metrics.requests.labels("grpc", rpc_name, code.name).inc()
        self.plane.metrics.latency.labels("grpc", rpc_name).observe(time.perf_counter() - started)

    @rpc(pb.ServerLiveRequest)
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @rpc(pb.ServerReadyRequest)
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.plane.ready())

    @rpc(pb.ModelReadyRequest)
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.plane.model_ready(request.name, request.version or None))

    @rpc(pb.ServerMetadataRequest)
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return v2_grpc.server_metadata(server_metadata(self.plane.regions.limit > 0))

    @rpc(pb.ModelMetadataRequest, serving=True)
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        model = self.plane.describe(request.name, request.version or None)
        limits = self.plane.limits
        return v2_grpc.model_metadata(model_metadata(model, limits.takes_pixels, limits.all_outputs))

    @rpc(pb.ModelConfigRequest, serving=True)
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        model = self.plane.describe(request.name, request.version or None)
        return pb.ModelConfigResponse(config=model_config(model, self.plane.batching, self.plane.limits))

    @rpc(pb.ModelInferRequest, serving=True, authorized=True)
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        name, version = request.model_name, request.model_version or None
        model = self.plane.describe(name, version)
        decoded = v2_grpc.decode(request, intake_for(model, self.plane.limits, self.plane.regions))
        asked = InferenceRequest(
            model, decoded.inputs, decoded.options, version, timeout_s=context.time_remaining(), texts=decoded.texts
        )
        return await self.plane.infer(asked, functools.partial(encode, decoded))

    @rpc(pb.ModelStatisticsRequest, serving=True)
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        stats = await self.plane.statistics(request.name or None, request.version or None)
        return v2_grpc.statistics_response(statistics_response(stats))

    @rpc(pb.RepositoryIndexRequest, serving=True)
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        return v2_grpc.repository_index(repository_index(await self.plane.repository_index(request.ready)))

    @rpc(pb.RepositoryModelLoadRequest, serving=True, authorized=True)
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        check_load_parameters(v2_grpc.parameters(request.parameters))
        await self.plane.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @rpc(pb.RepositoryModelUnloadRequest, serving=True, authorized=True)
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        await self.plane.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    @rpc(pb.SystemSharedMemoryStatusRequest, serving=True, authorized=True)
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.SystemSharedMemoryStatusResponse:
        return system_status_message(self.plane.regions.status(request.name or None))

    @rpc(pb.SystemSharedMemoryRegisterRequest, serving=True, authorized=True)
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self.plane.regions.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc(pb.SystemSharedMemoryUnregisterRequest, serving=True, authorized=True)
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self.plane.regions.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    @rpc(pb.CudaSharedMemoryStatusRequest, serving=True, authorized=True)
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.CudaSharedMemoryStatusResponse:
        cuda_status(request.name or None)  # none registered: errors.RegionNotFound for a name
        return pb.CudaSharedMemoryStatusResponse()

    @rpc(pb.CudaSharedMemoryRegisterRequest, serving=True, authorized=True)
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.CudaSharedMemoryRegisterResponse:
        raise errors.NotSupported(CUDA_NOT_SUPPORTED)

    @rpc(pb.CudaSharedMemoryUnregisterRequest, serving=True, authorized=True)
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()  # nothing is ever registered


def encode(decoded: Decoded, done: Inference) -> pb.ModelInferResponse:
    return v2_grpc.infer_response(decoded, done.predictions, done.model, done.classes, done.text_embeddings)


def serialize(message: Message) -> bytes:
    return message.SerializeToString()


class GrpcServer:
    """grpcio's asyncio server for one data plane, on `port` of every interface (with `reuse_port`, shared
    with the other serving front-ends: the kernel spreads the connections over them)."""

    def __init__(self, plane: DataPlane, port: int, max_message_bytes: int, reuse_port: bool = False) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"  # where a client on this machine reaches it
        self.server = grpc.aio.server(
            interceptors=grpc_interceptors(),  # a span per call when tracing is configured
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),  # larger: RESOURCE_EXHAUSTED
                ("grpc.max_send_message_length", -1),
                # a port in use is an error, not a second listener; serving front-ends share theirs
                ("grpc.so_reuseport", int(reuse_port)),
            ],
        )
        self.servicer = servicer = InferenceServicer(plane)
        rpcs = {
            name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name), response_serializer=serialize)
            for name in dir(servicer)
            if getattr(getattr(servicer, name), "rpc", False)
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, rpcs),))

    def hand_over(self, plane: DataPlane) -> None:
        """Serve `plane` from the next call on (the engine, once the models are loaded)."""
        self.servicer.plane = plane

    async def start(self) -> None:
        try:
            self.server.add_insecure_port(f"[::]:{self.port}")
        except RuntimeError as e:
            raise OSError(
                f"VIT_GRPC_PORT {self.port}: cannot listen ({e}); free the port, or set 0 to turn gRPC off"
            ) from None
        await self.server.start()
        log.info("gRPC (Open Inference Protocol) on port %d", self.port)

    async def stop(self, grace_s: float) -> None:
        """Stop taking RPCs, answer those under way (for at most `grace_s`), then close."""
        await self.server.stop(grace_s)
