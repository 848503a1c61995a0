"""A network that does not answer, for code that must not wait on it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def silent_endpoint() -> Iterator[str]:
    """`http://127.0.0.1:PORT` where connections are taken and never answered, as on a network whose packets are
    dropped: a client waits until its own timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)  # the kernel completes the handshakes; nothing ever reads or writes
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
