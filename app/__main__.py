"""`python -m app [--host H] [--port P]`: serve HTTP on H:P and gRPC on VIT_GRPC_PORT (settings from VIT_* variables)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys

from pydantic import ValidationError

from app.listen import listen_early
from app.startup import read_settings, startup_failed


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: one the system chooses)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    p.add_argument("--host", default="0.0.0.0", help="interface HTTP listens on (default 0.0.0.0)")
    p.add_argument(
        "--port",
        type=port_number,
        default=8000,
        help="HTTP port (default 8000; 0: one the system chooses, named in the log); gRPC listens on VIT_GRPC_PORT",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = read_settings()
    except ValidationError as e:  # said before the serving stack is imported
        return startup_failed(e)
    try:
        listening = listen_early(args.host, args.port, settings)  # connections wait while the stack is imported
    except OSError as e:
        return startup_failed(e)
    from app.server import serve

    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # uvloop is Linux and macOS only
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        code = runner.run(serve(args.host, args.port, settings, listening))
    # Stopped: what is still alive (torch, the models, the app) ends with the process. Frozen, it is left out of
    # the interpreter's last collections at exit, which would otherwise walk all of it once more.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
