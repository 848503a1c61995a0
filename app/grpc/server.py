"""The Open Inference Protocol over gRPC: an edge over the core's `Service`, on the HTTP server's event loop.

Each RPC converts its message with `app.codecs.v2_grpc`, calls the same core entry as V2 REST (same
models, batchers, limits, deadlines, API keys and metrics), and answers the core's errors with the
status codes of one table. Started and drained by the app's lifespan, beside the HTTP server.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from app.codecs import v2_grpc
from app.codecs.v2 import check_load_parameters, model_metadata, repository_index, server_metadata
from app.core.errors import (
    InferenceFailed,
    InvalidInput,
    LoadFailed,
    ModelNotFound,
    NotAllowed,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    ServiceError,
    Unauthorized,
    UnsupportedMediaType,
)
from app.core.service import Service
from app.grpc.proto import messages_pb2 as pb

log = logging.getLogger("app")
SERVICE = "inference.GRPCInferenceService"  # the RPCs' names on the wire: /inference.GRPCInferenceService/ModelInfer

Code = grpc.StatusCode
STATUS: dict[type[ServiceError], grpc.StatusCode] = {
    PayloadTooLarge: Code.RESOURCE_EXHAUSTED,
    UnsupportedMediaType: Code.INVALID_ARGUMENT,
    InvalidInput: Code.INVALID_ARGUMENT,
    Unauthorized: Code.UNAUTHENTICATED,
    ModelNotFound: Code.NOT_FOUND,
    Overloaded: Code.UNAVAILABLE,
    NotReady: Code.UNAVAILABLE,
    RequestTimeout: Code.DEADLINE_EXCEEDED,
    InferenceFailed: Code.INTERNAL,
    LoadFailed: Code.INVALID_ARGUMENT,
    NotAllowed: Code.FAILED_PRECONDITION,
}

Request = TypeVar("Request", bound=Message)
Response = TypeVar("Response", bound=Message)
Method = Callable[["InferenceServicer", Request, grpc.aio.ServicerContext], Awaitable[Response]]
Handler = Callable[["InferenceServicer", bytes, grpc.aio.ServicerContext], Awaitable[Response]]


def rpc(request_type: type[Request]) -> Callable[[Method[Request, Response]], Handler[Response]]:
    """An RPC that parses its own request (bytes that are no such message: INVALID_ARGUMENT, not UNKNOWN) and
    answers the core's errors with status codes, counted and timed as HTTP requests are."""

    def decorate(method: Method[Request, Response]) -> Handler[Response]:
        name = method.__name__

        @functools.wraps(method)
        async def answer(self: InferenceServicer, body: bytes, context: grpc.aio.ServicerContext) -> Response:
            started = time.perf_counter()
            code = Code.OK
            try:
                try:
                    request = request_type.FromString(body)
                except DecodeError:
                    raise InvalidInput(f"the request is not a valid {request_type.DESCRIPTOR.name} message") from None
                return await method(self, request, context)
            except ServiceError as e:
                code = STATUS.get(type(e), Code.INTERNAL)
                detail = e.detail
                if e.retry_after_s is not None:
                    detail += f" (retry after {e.retry_after_s} s)"
                    context.set_trailing_metadata((("retry-after", str(e.retry_after_s)),))
                await context.abort(code, detail)
            except grpc.aio.AbortError:
                raise
            except BaseException as e:  # cancelled (client gone, deadline) or a fault: never a crash
                if not isinstance(e, Exception):
                    code = Code.CANCELLED
                    raise
                code = Code.INTERNAL
                log.exception("unhandled error in gRPC %s", name)
                await context.abort(code, "internal error; see the server log")
            finally:
                seconds = time.perf_counter() - started
                self.service.metrics.requests.labels("grpc", name, code.name).inc()
                self.service.metrics.latency.labels("grpc", name).observe(seconds)
            raise AssertionError("unreachable: abort raises")

        answer.rpc = True  # type: ignore[attr-defined]
        return answer

    return decorate


class InferenceServicer:
    """inference.GRPCInferenceService over one `Service`: one method per RPC, named as the RPC."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def check_api_key(self, context: grpc.aio.ServicerContext) -> None:
        """With VIT_API_KEYS set: metadata x-api-key, or authorization: Bearer KEY."""
        if self.service.api_keys.required:
            metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
            given = metadata.get("x-api-key") or metadata.get("authorization", "")
            self.service.api_keys.check(given.removeprefix("Bearer ").strip())

    @rpc(pb.ServerLiveRequest)
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @rpc(pb.ServerReadyRequest)
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.ready)

    @rpc(pb.ModelReadyRequest)
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        model = self.service.models.get(request.name)
        ready = self.service.ready and model is not None and request.version in ("", model.version)
        return pb.ModelReadyResponse(ready=ready)

    @rpc(pb.ServerMetadataRequest)
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return v2_grpc.server_metadata(server_metadata())

    @rpc(pb.ModelMetadataRequest)
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        self.service.check_ready()
        return v2_grpc.model_metadata(model_metadata(self.service.model(request.name, request.version or None)))

    @rpc(pb.ModelInferRequest)
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        service = self.service
        service.check_ready()
        self.check_api_key(context)
        model = service.model(request.model_name, request.model_version or None)
        decoded = v2_grpc.decode(request, model.input_shape, service.settings.max_files)
        done = await service.infer(model, decoded.inputs, decoded.options, timeout_s=context.time_remaining())
        return await service.encode(done.predictions, v2_grpc.infer_response, decoded, done.predictions, done.model)

    @rpc(pb.RepositoryIndexRequest)
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        self.service.check_ready()
        statuses = await self.service.run_in_pool(self.service.model_set.index, request.ready)
        return v2_grpc.repository_index(repository_index(statuses))

    @rpc(pb.RepositoryModelLoadRequest)
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        self.service.check_ready()
        self.check_api_key(context)
        check_load_parameters(v2_grpc.parameters(request.parameters))
        await self.service.model_set.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @rpc(pb.RepositoryModelUnloadRequest)
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        self.service.check_ready()
        self.check_api_key(context)
        await self.service.model_set.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


def serialize(message: Message) -> bytes:
    return message.SerializeToString()


class GrpcServer:
    """grpcio's asyncio server for one `Service`, on `port` of every interface."""

    def __init__(self, service: Service, port: int, max_message_bytes: int) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"  # where a client on this machine reaches it
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),  # larger: RESOURCE_EXHAUSTED
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener
            ]
        )
        servicer = InferenceServicer(service)
        rpcs = {
            name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name), response_serializer=serialize)
            for name in dir(servicer)
            if getattr(getattr(servicer, name), "rpc", False)
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, rpcs),))

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
