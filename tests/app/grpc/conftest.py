from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from app.codecs.proto.service_pb2_grpc import GRPCInferenceServiceStub
from app.core.engine.engine import Engine
from app.grpc.server import GrpcServer
from harness.server import free_port
from tests.support.settings import cpu_settings


@dataclass
class Edge:
    """The core with its gRPC edge in this process, and a client stub over a real channel."""

    service: Engine
    server: GrpcServer
    stub: GRPCInferenceServiceStub


EdgeFactory = Callable[..., AbstractAsyncContextManager[Edge]]


@pytest.fixture
def make_edge(tiny_checkpoint: Path) -> EdgeFactory:
    """`async with make_edge(max_files=4) as edge:` the tiny checkpoint with torch on the CPU, served over gRPC."""

    @asynccontextmanager
    async def make(**overrides: Any) -> AsyncIterator[Edge]:
        port = free_port()
        settings = cpu_settings(**{"weights": tiny_checkpoint, "max_batch_size": 4, "grpc_port": port, **overrides})
        async with Engine.serving(settings) as service:
            server = GrpcServer(service, port, settings.grpc_message_limit())
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    yield Edge(service, server, GRPCInferenceServiceStub(channel))
            finally:
                await server.stop(5)

    return make


@pytest.fixture
async def edge(make_edge: EdgeFactory) -> AsyncIterator[Edge]:
    async with make_edge() as e:
        yield e
