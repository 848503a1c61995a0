"""The HTTP listening socket, bound (and, for one serving process, listening) before the serving stack is
imported: from the first second of a start, a client's connection waits to be answered (503 while the models
load) instead of being refused. Light on purpose: `python -m app` calls it before torch is imported."""

from __future__ import annotations

import errno
import socket
import sys
from pathlib import Path

from app.settings import Settings

BACKLOG = 2048  # uvicorn's default: connections waiting to be accepted


def bind_http(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The HTTP listening socket, bound now so that a port in use is an error before serving starts; with
    `reuse_port`, shared with the other serving front-ends (the kernel spreads the connections over them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise cannot_listen(host, port, e) from None
    sock.set_inheritable(True)
    return sock


def cannot_listen(host: str, port: int, e: OSError) -> OSError:
    """What to fix where HTTP cannot bind `host`:`port`: the host (no such name, or no address of this machine),
    or the port."""
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return OSError(f"HTTP host {host}: not an address of this machine ({e.strerror or e}); pass another --host")
    return OSError(f"HTTP port {host}:{port}: cannot listen ({e.strerror or e}); free the port or pass --port")


def listen_early(host: str, port: int, settings: Settings) -> socket.socket | None:
    """HTTP's socket, listening now, where this start serves from one process as far as can be told without
    importing torch (VIT_WORKERS=1, or auto without a GPU: on CPU, or on Linux with no NVIDIA device); None where
    serving processes may be started (their front-ends listen on ports of their own). OSError (what to fix) where
    it cannot listen."""
    if not one_process(settings):
        return None
    sock = bind_http(host, port)
    sock.listen(BACKLOG)
    return sock


def one_process(settings: Settings) -> bool:
    if settings.workers != "auto":
        return settings.workers == "1"
    return settings.device == "cpu" or (sys.platform == "linux" and not Path("/dev/nvidiactl").exists())
