"""The HTTP protocol's transport joins the writes of one go of the event loop: a response's head and body leave
in one write, in order, and nothing written before a close or after a flush is lost or reordered."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn

from app.web.http_protocol import JoinedWrites, JoinedWritesHttpProtocol


class Recording(asyncio.Transport):
    """A transport that records what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5)}.get(name, default)


async def test_the_writes_of_one_go_leave_as_one_in_order() -> None:
    real = Recording()
    joined = JoinedWrites(real, asyncio.get_running_loop())
    joined.write(b"HTTP/1.1 200 OK\r\n\r\n")
    joined.write(memoryview(b"body"))
    assert real.writes == [] and joined.get_write_buffer_size() == len(b"HTTP/1.1 200 OK\r\n\r\nbody")
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    joined.write(b"later")  # a later go: a write of its own
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"later"]
    assert joined.get_extra_info("peername") == ("127.0.0.1", 5)  # the rest is the transport's


async def test_a_close_sends_what_was_written_first_and_an_abort_drops_it() -> None:
    real = Recording()
    joined = JoinedWrites(real, asyncio.get_running_loop())
    joined.write(b"head")
    joined.write(b"body")
    joined.close()
    assert real.writes == [b"headbody"] and real.closed
    await asyncio.sleep(0)
    assert real.writes == [b"headbody"]  # the scheduled flush finds nothing left
    other = Recording()
    joined = JoinedWrites(other, asyncio.get_running_loop())
    joined.write(b"head")
    joined.abort()
    await asyncio.sleep(0)
    assert other.writes == [] and other.aborted


@pytest.fixture
async def served() -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        more = scope["path"] == "/stream"
        headers = [(b"content-type", b"text/plain")] + ([] if more else [(b"content-length", b"6")])
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"first;", "more_body": more})
        if more:
            await asyncio.sleep(0.05)
            await send({"type": "http.response.body", "body": b"second"})

    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=JoinedWritesHttpProtocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    await task


async def read_response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head:
        return head + await reader.readuntil(b"0\r\n\r\n")
    length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


async def test_uvicorn_serves_through_it_with_keep_alive_and_streamed_bodies(served: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    for path in ("/", "/stream", "/"):  # one connection, kept alive
        writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        response = await asyncio.wait_for(read_response(reader), 5)
        assert response.startswith(b"HTTP/1.1 200 OK\r\n")
        body = response.split(b"\r\n\r\n", 1)[1]
        assert (b"first;" in body and b"second" in body) if path == "/stream" else body == b"first;"
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    response = await asyncio.wait_for(reader.read(), 5)  # everything written before the server closed
    assert response.startswith(b"HTTP/1.1 200 OK\r\n") and response.endswith(b"first;")
    writer.close()
