"""Watching the connection while a request waits: an HTTP concern, kept at the edge with the routes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request, Response

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left; never delivered


class ClientDisconnected(Exception):
    """The client went away while its request waited; nothing is sent back."""


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`; if the client leaves first, `work` is cancelled and ClientDisconnected raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        waiting: set[asyncio.Future[Any]] = {task, watcher}
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()  # cancels the request's queued images: the batcher never computes them
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def respond_unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """The response `work` makes, or 499 (logged, never delivered) when the client leaves first."""
    try:
        return await unless_disconnected(request, work)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
