"""uvicorn's httptools protocol, writing each response in one system call.

uvicorn writes a response's head when the app sends `http.response.start` and its body on
`http.response.body`: two writes to the socket, each a system call that uvloop makes holding the GIL (on
loopback the kernel's TCP work for the receiver runs in that call too). Here the writes made in one go of
the event loop are joined and leave together at the end of it, so a response sent at once costs one.
Nothing else changes: a streamed body still leaves as the app sends it, a go later at most.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class JoinedWrites:
    """`transport` with the writes of one go of the event loop joined into one; everything else passed on."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.loop = loop
        self.pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.pending:
            self.loop.call_soon(self.flush)
        self.pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.pending:
            data = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
            self.pending = []
            if not self.transport.is_closing():
                self.transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() + sum(len(p) for p in self.pending)

    def write_eof(self) -> None:
        self.flush()
        self.transport.write_eof()

    def close(self) -> None:
        self.flush()  # what the response wrote goes before the connection closes
        self.transport.close()

    def abort(self) -> None:
        self.pending = []
        self.transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, resume_reading, ...
        return getattr(self.transport, name)


class JoinedWritesHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol over `JoinedWrites`: one write per response sent at once."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(JoinedWrites(transport, self.loop))  # type: ignore[arg-type]
